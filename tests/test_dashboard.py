"""The dashboard in a real browser (Debian's Chromium driven by Playwright) over a real SQLite
registry served by uvicorn; its bad inputs, pagination and `ckval ui` without a browser."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi.testclient import TestClient

from validation_service import StopPolicy
from validation_service.api import create_app
from validation_service.cli import main as ckval_main
from validation_service.cli.ui import ui_command
from validation_service.config import Settings
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parent.parent
SETTINGS = Settings(service_name="ckval-dashboard-test-none")
SPEC = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="f", validate_fn_ref="json:dumps"
)
ALPHA_ACCURACY = [0.61, 0.72, 0.70, 0.83]  # validated reports 0-3; 4 fails, 5 stays queued
BETA_ACCURACY = [0.55, 0.66, 0.79]
WAIT_MS = 20_000


@dataclasses.dataclass
class Served:
    registry: Registry
    url: str
    queued_job: int  # alpha's report 5, still QUEUED


def _register(registry: Registry, root: Path, run: str, losses: list[float]) -> list[int]:
    run_id = registry.ledger.ensure_run(run, storage_root=str(root))
    return [
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{root}/{run}/checkpoint_{index:06d}",
            size_bytes=2048 * (index + 1),
            manifest_sha256=None,
            reported_metrics={"loss": loss, "grad_norm": math.inf if index == 1 else 1.0},
            step=100 * index,
            job=SPEC,
        ).job_id
        for index, loss in enumerate(losses)
    ]


def _finish(registry: Registry, outcomes: dict[int, JobOutcome]) -> None:
    """Claims the due jobs as a scheduler would and records the given outcomes."""
    tokens = {
        c.job_id: c.lease_token
        for c in registry.job_queue.claim_due_jobs("dashboard-test", {"CPU": 100}, lease_s=600)
    }
    for job_id, outcome in outcomes.items():
        assert registry.job_queue.finish_job(job_id, tokens[job_id], outcome)


def _validated(accuracy: float) -> JobOutcome:
    now = dt.datetime.now(dt.timezone.utc)
    return JobOutcome(
        succeeded=True, metrics={"accuracy": accuracy}, started_at=now, finished_at=now
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s")
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """Two runs in a SQLite registry, served by uvicorn on a loopback port in a thread."""
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    alpha = _register(registry, tmp_path, "alpha", [0.9, 0.7, 0.6, 0.5])
    beta = _register(registry, tmp_path, "beta", [1.0, 0.8, 0.6])
    outcomes = {job: _validated(a) for job, a in zip(alpha, ALPHA_ACCURACY, strict=True)}
    outcomes |= {job: _validated(a) for job, a in zip(beta, BETA_ACCURACY, strict=True)}
    _finish(registry, outcomes)
    failing = _register_more(registry, tmp_path, "alpha", 4, 0.45)
    _finish(
        registry,
        {
            failing: JobOutcome(
                succeeded=False,
                error_type="ValueError",
                error_message="checkpoint has no 'model' key",
                error_traceback='Traceback (most recent call last):\n  File "eval.py", '
                "line 3, in validate\nValueError: checkpoint has no 'model' key",
                retryable=False,
            )
        },
    )
    queued = _register_more(registry, tmp_path, "alpha", 5, 0.4)
    with _serving(registry) as url:
        yield Served(registry, url, queued)
    registry.close()


@contextlib.contextmanager
def _serving(registry: Registry) -> Iterator[str]:
    """The API over ``registry``, served by uvicorn on a loopback port in a thread."""
    port = _free_port()
    config = uvicorn.Config(
        create_app(SETTINGS, registry), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_until(lambda: server.started, "uvicorn start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _register_more(registry: Registry, root: Path, run: str, index: int, loss: float) -> int:
    run_id = registry.ledger.ensure_run(run, storage_root=str(root))
    return registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"{root}/{run}/checkpoint_{index:06d}",
        size_bytes=4096,
        manifest_sha256=None,
        reported_metrics={"loss": loss},
        step=100 * index,
        job=SPEC,
    ).job_id


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is required in CI (.ci/setup installs it)")
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Whatever the Content-Security-Policy refuses (an inline style or script, a file of
    # another site) is a console error: the pages must need none of it.
    page.on(
        "console",
        lambda message: (
            errors.append(message.text)
            if message.type == "error" and "Content Security Policy" in message.text
            else None
        ),
    )
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _wait_for(page, expression: str) -> None:
    """Waits until a JavaScript expression is true on the page. Evaluated from outside
    the page: Playwright's wait_for_function compiles its predicate inside the page,
    which the page's Content-Security-Policy (no eval) refuses."""
    _wait_until(lambda: page.evaluate(expression), expression, timeout_s=WAIT_MS / 1000)


def _series(page, metric: str, index: int) -> list:
    return page.evaluate(f"window.ckval.plots[{metric!r}].data[{index}]")


# ------------------------------------------------------------------ browser
def test_runs_page_lists_runs_with_counts_and_best_metric(served: Served, page):
    page.goto(f"{served.url}/ui/?metric=accuracy")
    page.wait_for_selector("#runs tbody tr[data-run='alpha']")
    names = page.eval_on_selector_all("#runs tbody tr", "rows => rows.map(r => r.dataset.run)")
    assert names == ["alpha", "beta"]  # alpha changed last
    cells = page.eval_on_selector_all(
        "#runs tr[data-run='alpha'] td", "cells => cells.map(c => c.textContent)"
    )
    # checkbox, name, namespace, status, checkpoints, validated, queued, running, failed, best
    assert cells[1:10] == ["alpha", "default", "RUNNING", "6", "4", "1", "0", "1", "0.83"]
    options = page.eval_on_selector_all("#metric option", "o => o.map(x => x.value)")
    assert {"accuracy", "loss", "grad_norm"} <= set(options)
    # Choosing another metric re-ranks without reloading the page: loss is lower-is-better.
    page.select_option("#metric", "loss")
    _wait_for(
        page, "document.querySelector(\"#runs tr[data-run='beta'] td.best\").textContent === '0.6'"
    )
    assert page.input_value("#mode") == "min"
    assert page.text_content("#runs tr[data-run='alpha'] td.best") == "0.4"


def test_run_page_plots_each_metric_with_its_best_point(served: Served, page):
    page.goto(f"{served.url}/ui/runs/alpha")
    page.wait_for_selector(".plot[data-metric='accuracy'] canvas")
    assert _series(page, "accuracy", 0) == [0, 1, 2, 3, 4, 5]  # report indexes
    assert _series(page, "accuracy", 2) == [*ALPHA_ACCURACY, None, None]  # validated
    best = _series(page, "accuracy", 3)
    assert best == [None, None, None, 0.83, None, None]
    assert _series(page, "loss", 1) == [0.9, 0.7, 0.6, 0.5, 0.45, 0.4]  # reported
    assert _series(page, "loss", 3)[5] == 0.4  # lowest loss is best
    # grad_norm was infinite at report 1: no point there.
    assert _series(page, "grad_norm", 1)[1] is None
    assert page.locator(".plot canvas").count() == 3
    assert "best 0.83 at report 3" in page.text_content(".plot[data-metric='accuracy'] h3")
    assert page.locator("#checkpoints tbody tr").count() == 6
    assert page.locator("#timeline svg g.job").count() == 6


def test_run_page_expands_a_failed_jobs_traceback(served: Served, page):
    page.goto(f"{served.url}/ui/runs/alpha")
    details = page.locator("#jobs details")
    details.wait_for()
    assert "ValueError: checkpoint has no 'model' key" in details.locator("summary").inner_text()
    assert not page.locator("#jobs details pre").is_visible()
    details.locator("summary").click()
    assert "line 3, in validate" in page.locator("#jobs details pre").inner_text()


def test_run_page_updates_when_a_validation_finishes(served: Served, page):
    page.goto(f"{served.url}/ui/runs/alpha")
    page.wait_for_selector(".plot[data-metric='accuracy'] canvas")
    assert page.text_content("#checkpoints tr[data-report='5'] .status") == "PENDING"
    _finish(served.registry, {served.queued_job: _validated(0.91)})
    _wait_for(page, "window.ckval.plots.accuracy.data[2][5] === 0.91")
    _wait_for(
        page,
        "document.querySelector(\"#checkpoints tr[data-report='5'] .status\").textContent"
        " === 'VALIDATED'",
    )
    assert _series(page, "accuracy", 3)[5] == 0.91  # the new best
    assert page.text_content(f"#jobs tr[data-job='{served.queued_job}'] .status") == "SUCCEEDED"
    if os.environ.get("CKVAL_WRITE_SCREENSHOT") == "1":
        page.screenshot(path=str(REPO / "docs" / "dashboard.png"), full_page=True)


def test_run_page_shows_a_warning_stored_with_a_job(served: Served, page):
    job = served.registry.validations("alpha")[0].id
    served.registry.job_queue.add_warnings(job, ["sink mlflow: logged to its own run"])
    page.goto(f"{served.url}/ui/runs/alpha")
    warning = page.locator(f"#jobs tr[data-job='{job}'] .warning")
    warning.wait_for()
    assert warning.inner_text() == "warning: sink mlflow: logged to its own run"
    assert page.locator("#jobs .warning").count() == 1


def test_run_page_says_how_many_metrics_it_shows_and_shows_others_on_request(tmp_path: Path, page):
    """A run of 60 metrics: the page plots the first 50, says so, and the picker shows
    one of the others instead (the data asked for it only; the address keeps it)."""
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    run_id = registry.ledger.ensure_run("wide", storage_root=str(tmp_path))
    names = [f"m{i:02d}" for i in range(60)]
    for index in range(2):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{tmp_path}/wide/checkpoint_{index:06d}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={name: float(index + i) for i, name in enumerate(names)},
        )
    with _serving(registry) as url:
        page.goto(f"{url}/ui/runs/wide")
        page.wait_for_selector(".plot[data-metric='m49'] canvas")
        note = page.locator("#metrics-note")
        assert note.inner_text() == (
            "Showing 50 of 60 metrics (the first 50 reported; choose others below)."
        )
        assert page.locator(".plot").count() == 50
        assert page.locator(".plot[data-metric='m55']").count() == 0

        page.click("#metric-picker summary")
        page.select_option("#metric-choice", ["m55"])
        page.click("#show-chosen")
        _wait_for(page, "Object.keys(window.ckval.plots).join() === 'm55'")
        assert note.inner_text() == "Showing 1 of 60 metrics (chosen below)."
        assert page.locator(".plot").count() == 1
        assert _series(page, "m55", 1) == [55.0, 56.0]
        assert page.text_content("#checkpoints tr[data-report='1'] td.metrics") == "m55=56"
        assert "metric=m55" in page.url

        page.click("#show-first")
        _wait_for(page, "Object.keys(window.ckval.plots).length === 50")
        assert "m55" not in page.evaluate("Object.keys(window.ckval.plots)")
        assert "metric=" not in page.url
    registry.close()


STOPPED_ACCURACY = [0.70, 0.80, 0.79, 0.78]  # patience 2: decided at report 3


def test_run_page_marks_the_stop_decision_and_its_override(tmp_path: Path, page):
    """A policy decides on a real registry (the job's finish judges it); each plot of the
    run draws a line at the deciding report, labelled with the rule and the values, and
    the label says so once the decision is overridden."""
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    registry.set_stop_policy("gamma", StopPolicy("accuracy", patience=2))
    jobs = _register(registry, tmp_path, "gamma", [0.9, 0.8, 0.7, 0.6])
    _finish(registry, {job: _validated(a) for job, a in zip(jobs, STOPPED_ACCURACY, strict=True)})
    decision = registry.stop_decision("gamma")
    assert (decision.rule, decision.report_index, decision.stopped) == ("patience", 3, True)
    with _serving(registry) as url:
        page.goto(f"{url}/ui/runs/gamma")
        marker = page.locator(".plot[data-metric='accuracy'] .stop-marker")
        marker.wait_for()
        assert marker.get_attribute("data-report-index") == "3"
        assert marker.get_attribute("data-stopped") == "true"
        assert marker.locator(".stop-rule").inner_text() == "stop: patience at report 3"
        values = marker.locator(".stop-values").inner_text()
        assert values == "accuracy 0.8 (report 1), 0.79 (report 2), 0.78 (report 3); best 0.8"
        assert "did not improve on 0.8 (report 1)" in marker.get_attribute("title")
        # Drawn where the plot puts report 3, on every metric's plot.
        left = page.evaluate(
            "[window.ckval.plots.accuracy.valToPos(3, 'x'), parseFloat(document.querySelector("
            "\".plot[data-metric='accuracy'] .stop-marker\").style.left)]"
        )
        assert left[0] > 0 and abs(left[0] - left[1]) < 0.5, left
        assert page.locator(".plot .stop-marker").count() == 3  # accuracy, loss, grad_norm
        note = page.text_content("#stop-decision")
        assert "Stop policy: accuracy (max): patience 2." in note
        assert "Decision: accuracy did not improve" in note

        registry.resume_despite_stop("gamma")
        page.evaluate("window.ckval.refreshNow()")
        _wait_for(page, "window.ckval.data.stop_decision.stopped === false")
        _wait_for(
            page,
            "document.querySelector(\".plot[data-metric='accuracy'] .stop-marker\")"
            ".dataset.stopped === 'false'",
        )
        rule = marker.locator(".stop-rule").inner_text()
        assert rule == "stop: patience at report 3 · overridden, resumed after report 3"
        assert "training resumed after report 3" in page.text_content("#stop-decision")
    registry.close()


def test_run_data_has_no_stop_marker_without_a_policy(client: TestClient):
    content = client.get("/ui/api/runs/alpha").json()
    assert content["stop_policy"] is None and content["stop_decision"] is None


def test_api_docs_page_lists_the_routes_and_loads_nothing_from_another_site(served: Served, page):
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{served.url}/docs")
    page.wait_for_selector("body[data-ready='true']", timeout=WAIT_MS)
    route = page.locator("section.route[data-path='/runs/{run}/checkpoints']")
    assert route.get_attribute("data-method") == "GET"
    assert "run *" in route.locator("td.name").all_inner_texts()
    assert page.locator("section.route").count() >= 20
    assert requested and all(url.startswith(served.url + "/") for url in requested), requested


def test_compare_page_plots_one_metric_of_several_runs(served: Served, page):
    page.goto(f"{served.url}/ui/compare?runs=alpha,beta&metric=accuracy")
    page.wait_for_selector("#compare-plot canvas")
    data = page.evaluate("window.ckval.plots.compare.data")
    assert data[0] == [0, 1, 2, 3]
    assert data[1] == ALPHA_ACCURACY
    assert data[2] == [*BETA_ACCURACY, None]
    legend = page.eval_on_selector_all("#compare-legend a", "a => a.map(x => x.textContent)")
    assert legend == ["alpha", "beta"]


def test_runs_page_compare_button_opens_the_comparison(served: Served, page):
    page.goto(f"{served.url}/ui/?metric=accuracy")
    page.check("#runs tr[data-run='alpha'] input")
    page.check("#runs tr[data-run='beta'] input")
    page.click("#compare")
    page.wait_for_selector("#compare-plot canvas")
    assert page.evaluate("window.ckval.plots.compare.series.length") == 3  # x + two runs


# ------------------------------------------------------- bad input, no browser
@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    jobs = _register(registry, tmp_path, "alpha", [0.9, 0.7])
    _finish(registry, {job: _validated(0.5) for job in jobs})
    # localhost: the API answers only to the names it is served under.
    with TestClient(create_app(SETTINGS, registry), base_url="http://localhost") as test_client:
        yield test_client
    registry.close()


def test_unknown_run_page_is_404_naming_the_run(client: TestClient):
    response = client.get("/ui/runs/nope")
    assert response.status_code == 404
    assert "text/html" in response.headers["content-type"]
    assert "No run named &#39;nope&#39;" in response.text and "Known runs: alpha" in response.text


def test_run_data_and_page_show_aliases_and_tags(client: TestClient):
    registry = client.app.state.registry
    registry.set_alias("alpha", "production", 1)
    registry.tag("alpha", 1, "split", "val")
    checkpoints = client.get("/ui/api/runs/alpha").json()["checkpoints"]
    by_index = {c["report_index"]: c for c in checkpoints}
    assert by_index[1]["aliases"] == ["production"] and by_index[1]["tags"] == {"split": "val"}
    assert by_index[0]["aliases"] == [] and by_index[0]["tags"] == {}
    page = client.get("/ui/runs/alpha").text
    assert "production" in page and "split" in page


def test_unknown_run_data_is_404_json(client: TestClient):
    response = client.get("/ui/api/runs/nope")
    assert response.status_code == 404
    assert response.json()["error"] == "RunNotFound"


def test_compare_with_no_run_names_is_422(client: TestClient):
    response = client.get("/ui/api/compare", params={"runs": " , ", "metric": "loss"})
    assert response.status_code == 422
    assert "names no run" in response.json()["detail"]


def test_compare_of_too_many_runs_is_422(client: TestClient):
    runs = ",".join(f"run-{i}" for i in range(21))
    response = client.get("/ui/api/compare", params={"runs": runs, "metric": "loss"})
    assert response.status_code == 422
    assert "at most 20" in response.json()["detail"]


def test_compare_without_a_metric_is_422(client: TestClient):
    response = client.get("/ui/compare", params={"runs": "alpha"})
    assert response.status_code == 422
    assert "compare needs metric=NAME" in response.text


def test_compare_of_an_unknown_metric_is_404_listing_the_known_ones(client: TestClient):
    response = client.get("/ui/api/compare", params={"runs": "alpha", "metric": "bleu"})
    assert response.status_code == 404
    detail = response.json()["detail"]
    assert "'bleu'" in detail and "accuracy, grad_norm, loss" in detail


def test_compare_of_an_unknown_run_is_404(client: TestClient):
    response = client.get("/ui/compare", params={"runs": "alpha,nope", "metric": "loss"})
    assert response.status_code == 404
    assert "No run named &#39;nope&#39;" in response.text


def test_page_number_below_one_is_422(client: TestClient):
    response = client.get("/ui/api/runs", params={"page": 0})
    assert response.status_code == 422
    assert "page" in response.json()["detail"]


def test_unknown_mode_is_422(client: TestClient):
    response = client.get("/ui/api/runs", params={"mode": "best"})
    assert response.status_code == 422
    assert "mode" in response.json()["detail"]


def test_unknown_static_file_is_404(client: TestClient):
    response = client.get("/ui/static/../api.py")
    assert response.status_code == 404
    response = client.get("/ui/static/app.js")
    assert response.status_code == 404
    assert "dashboard.js" in response.json()["detail"]


def test_vendored_uplot_and_its_licence_are_served(client: TestClient):
    script = client.get("/ui/static/uPlot.iife.min.js")
    assert script.status_code == 200 and "uPlot" in script.text[:200]
    assert "MIT License" in client.get("/ui/static/LICENSE.uPlot").text


def test_pages_name_no_outside_address(client: TestClient):
    for url in ("/ui/", "/ui/runs/alpha", "/ui/compare?runs=alpha&metric=loss"):
        html = client.get(url).text
        assert "http://" not in html and "https://" not in html, url


# ----------------------------------------------------------- pagination, order
def test_runs_are_paged_newest_activity_first(registry: Registry, tmp_path: Path):
    for name in ("r0", "r1", "r2"):
        _register(registry, tmp_path, name, [1.0])
    _register_more(registry, tmp_path, "r0", 1, 0.5)  # r0 is now the most recent
    first = registry.dashboard.run_page(page=1, per_page=2, metric="loss")
    second = registry.dashboard.run_page(page=2, per_page=2, metric="loss")
    assert [r.run.name for r in first.runs] == ["r0", "r2"]
    assert [r.run.name for r in second.runs] == ["r1"]
    assert first.total == second.total == 3 and first.mode == "min"
    assert first.runs[0].best == 0.5 and first.runs[0].checkpoints == 2
    assert first.runs[0].job_counts == {"QUEUED": 2}
    # A job's change is activity too: finishing r1's job (the last change) moves it first.
    r1_job = registry.validations("r1")[0].id
    _finish(registry, {r1_job: _validated(0.7)})
    assert registry.dashboard.run_page(per_page=3).runs[0].run.name == "r1"


# ----------------------------------------------------------------- ckval ui
def test_ckval_ui_rejects_a_port_out_of_range():
    result = CliRunner().invoke(ui_command, ["--port", "70000"])
    assert result.exit_code == 2
    assert "70000 is not a TCP port" in result.output


def test_ckval_ui_refuses_an_open_address_without_a_token(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("CKVAL_API_TOKEN", raising=False)
    url = f"sqlite:///{tmp_path}/registry.db"
    result = CliRunner().invoke(
        ckval_main, ["--database-url", url, "ui", "--host", "0.0.0.0", "--port", "1"]
    )
    assert result.exit_code == 2, result.output
    assert "without a token" in result.output and "CKVAL_API_TOKEN" in result.output
    assert not (tmp_path / "registry.db").exists()  # refused before the registry opened


def test_ckval_ui_names_a_database_it_cannot_open(tmp_path: Path):
    # A missing folder is created (the embedded default needs that), so the registry's
    # folder here is a file: nothing can be created under it.
    (tmp_path / "a-file").write_text("")
    unusable = f"sqlite:///{tmp_path}/a-file/registry.db"
    port = str(_free_port())  # were it to open, it would serve there, not on a port in use
    result = CliRunner().invoke(ui_command, ["--port", port], env={"CKVAL_DATABASE_URL": unusable})
    assert result.exit_code == 1
    assert "a-file" in result.output and "cannot be created" in result.output


def test_ckval_ui_serves_dashboard_and_metrics_without_ray(tmp_path: Path):
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    _register(registry, tmp_path, "alpha", [0.9])
    registry.close()
    with _ckval_ui(tmp_path, "127.0.0.1", os.environ) as base:
        with urllib.request.urlopen(f"{base}/ui/") as response:
            assert b"ckval" in response.read()
        with urllib.request.urlopen(f"{base}/metrics") as response:
            assert b'ckval_jobs{pool="CPU",status="QUEUED"} 1.0' in response.read()
        # The service route says Ray is not running in this process: ckval ui started none.
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"{base}/service")
        assert raised.value.code == 503
        assert b"Ray is not initialized" in raised.value.read()


def test_ckval_ui_answers_the_host_it_serves_on(tmp_path: Path):
    """`ckval ui --host 127.0.0.2`: a browser sends that address as Host, and it is one
    the API answers (not only localhost and CKVAL_HTTP_HOST)."""
    Registry(f"sqlite:///{tmp_path}/registry.db").close()
    env = {k: v for k, v in os.environ.items() if k not in ("CKVAL_HTTP_HOST", "CKVAL_API_HOSTS")}
    with _ckval_ui(tmp_path, "127.0.0.2", env) as base:
        with urllib.request.urlopen(f"{base}/ui/") as response:
            assert response.status == 200 and b"ckval" in response.read()


@contextlib.contextmanager
def _ckval_ui(tmp_path: Path, host: str, env: dict[str, str]):
    """`ckval ui --host HOST` on a free port over tmp_path's registry, in a process of its
    own; yields its base URL once /healthz answers, and stops it after."""
    port = _free_port()
    env = {
        **env,
        "CKVAL_DATABASE_URL": f"sqlite:///{tmp_path}/registry.db",
        "PYTHONPATH": str(REPO),
    }
    program = "from validation_service.cli.ui import ui_command; ui_command()"
    process = subprocess.Popen(
        [sys.executable, "-c", program, "--host", host, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://{host}:{port}"
    try:
        _wait_until(lambda: _answers(f"{base}/healthz"), "ckval ui answering", timeout_s=120)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------- benchmark
def test_benchmark_dashboard_smoke(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_dashboard.py", "--smoke", "--backends", "sqlite"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "CKVAL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sqlite |")]
    assert len(rows) == 9  # every endpoint, and the first /metrics scrape
    assert any("| /metrics |" in row for row in rows)


def test_run_page_plots_two_validators_of_one_metric_and_picks_one(tmp_path: Path, page):
    """A run validated by report()'s own validator and re-validated by two named ones:
    each accuracy plot draws report()'s line and a dashed line per named validator; the
    picker keeps one of them, and the checkpoints' table lists every validator's values."""
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    jobs = _register(registry, tmp_path, "evals", [0.9, 0.7, 0.6])
    _finish(registry, {job: _validated(a) for job, a in zip(jobs, [0.5, 0.6, 0.7], strict=True)})
    for validator, offset in (("v2", 0.2), ("mmlu", -0.3)):
        named = registry.revalidate("evals", "json:dumps", validator=validator)
        _finish(registry, {job: _validated(0.5 + offset + 0.1 * i) for i, job in enumerate(named)})
    with _serving(registry) as url:
        page.goto(f"{url}/ui/runs/evals")
        page.wait_for_selector(".plot[data-metric='accuracy'] canvas")
        plot = ".plot[data-metric='accuracy']"
        assert page.get_attribute(plot, "data-validators") == "mmlu,v2"
        assert _series(page, "accuracy", 2) == [0.5, 0.6, 0.7]  # report()'s validation
        assert [round(v, 3) for v in _series(page, "accuracy", 3)] == [0.2, 0.3, 0.4]  # mmlu
        assert [round(v, 3) for v in _series(page, "accuracy", 4)] == [0.7, 0.8, 0.9]  # v2
        row = "#checkpoints tr[data-report='2'] .evaluation"
        assert page.eval_on_selector_all(row, "rows => rows.map(r => r.textContent)") == [
            "mmlu: accuracy=0.4",
            "v2: accuracy=0.9",
        ]

        page.select_option("#validator-choice", "v2")
        _wait_for(page, 'document.querySelector("' + plot + "\").dataset.validators === 'v2'")
        assert [round(v, 3) for v in _series(page, "accuracy", 3)] == [0.7, 0.8, 0.9]
        assert "validator=v2" in page.url
        page.reload()
        page.wait_for_selector(".plot[data-metric='accuracy'] canvas")
        assert page.get_attribute(plot, "data-validators") == "v2"
    registry.close()
