"""`ckval revalidate`, `ckval register`, the listings' --validator, `ckval job N --log`
and the HTTP API's revalidate and best?validator=, on SQLite and PostgreSQL. Attempts run
in this process (an in-process scheduler, on a thread while the CLI waits)."""

from __future__ import annotations

import json
import sys
import threading

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.test_revalidate import PROGRAM, VALUES, program, reported_run, settle
from validation_service.api import create_app
from validation_service.cli import main
from validation_service.config import Settings
from validation_service.registry.registry import Registry


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    """The registry's URL with this session's home (its signing key is the CLI's too)."""
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(database_url=url, storage=str(tmp_path / "s"))


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def ckval(settings: Settings, *args: str):
    storage = {"CKVAL_STORAGE": settings.storage}
    return CliRunner().invoke(main, ["--database-url", settings.database_url, *args], env=storage)


def command_line(tmp_path) -> str:
    return " ".join(program(tmp_path, PROGRAM))


def test_revalidate_then_list_rank_and_read_the_log(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)

    queued = ckval(
        settings, "revalidate", unique_run, "--validator", "v2", "--command", command_line(tmp_path)
    )
    assert queued.exit_code == 0, queued.output
    assert "queued 5 job(s) of validator 'v2'" in queued.output
    jobs = settle(reg, settings, [j.id for j in reg.validations(unique_run) if j.validator == "v2"])
    again = ckval(
        settings, "revalidate", unique_run, "--validator", "v2", "--command", command_line(tmp_path)
    )
    listed = ckval(settings, "checkpoints", unique_run, "--validator", "v2", "--json")
    best = ckval(settings, "best", unique_run, "--metric", "score", "--validator", "v2")
    log = ckval(settings, "job", str(jobs[3].id), "--log")
    shown = ckval(settings, "job", str(jobs[3].id))

    assert "queued 0 job(s)" in again.output and "skipped 5 checkpoint(s)" in again.output
    evaluations = [c["evaluations"] for c in json.loads(listed.output)]
    assert [e["v2"]["score"] for e in evaluations] == [v * 2 for v in VALUES]
    assert [e["default"]["score"] for e in evaluations] == VALUES
    assert best.exit_code == 0 and "1.8" in best.output, best.output
    assert "evaluating step 3" in log.output and "=== attempt 1 (SUCCEEDED) ===" in log.output
    assert "validator" in shown.output and "v2" in shown.output


def test_revalidate_waits_with_a_progress_line_and_fails_on_failures(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)
    failing = program(tmp_path, "import sys; sys.exit(3)", "failing.py")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            jobs = [j.id for j in reg.validations(unique_run) if j.status == "QUEUED"]
            if jobs:
                settle(reg, settings, jobs)
            stop.wait(0.1)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        good = ckval(
            settings,
            *("revalidate", unique_run, "--validator", "v2", "--reports", "1,3"),
            *("--command", command_line(tmp_path), "--wait"),
        )
        bad = ckval(
            settings,
            *("revalidate", unique_run, "--validator", "bad", "--reports", "0"),
            *("--command", " ".join(failing), "--wait"),
        )
    finally:
        stop.set()
        worker.join()

    assert good.exit_code == 0, good.output
    assert "validator 'v2': 2 SUCCEEDED" in good.output
    assert bad.exit_code == 1 and "validator 'bad': 1 FAILED" in bad.output


def test_revalidate_with_a_filter_and_bad_arguments(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)

    filtered = ckval(
        settings,
        *("revalidate", "--filter", "metrics.score > 0.6", "--validator", "top"),
        *("--validate-fn", "tests.test_revalidate:read_value"),
    )
    no_fn = ckval(settings, "revalidate", unique_run, "--validator", "v2")
    of_reports = ("revalidate", unique_run, "--validator", "v", "--validate-fn", "json:dumps")
    bad_reports = ckval(settings, *of_reports, "--reports", "0,x")
    missing_report = ckval(settings, *of_reports, "--reports", "9")
    bad_name = ckval(
        settings, "revalidate", unique_run, "--validator", "a/b", "--validate-fn", "json:dumps"
    )

    assert filtered.exit_code == 0 and "queued 2 job(s)" in filtered.output, filtered.output
    assert no_fn.exit_code == 2 and "--validate-fn" in no_fn.output
    assert bad_reports.exit_code == 2 and "report indices separated by commas" in bad_reports.output
    assert missing_report.exit_code == 2 and "no checkpoint at report index [9]" in (
        missing_report.output
    )
    assert bad_name.exit_code == 2 and "validator name" in bad_name.output
    assert {j.validator for j in reg.validations(unique_run)} == {"default", "top"}


def test_register_then_gc_keeps_the_outside_folder(reg, settings, tmp_path, unique_run):
    reported_run(tmp_path, settings, reg, unique_run)
    released = tmp_path / "released"
    released.mkdir()
    (released / "value.json").write_text(json.dumps({"value": 0.2}))

    added = ckval(settings, "register", unique_run, str(released), "--metrics", '{"score": 0.2}')
    gone = ckval(
        settings,
        "gc",
        unique_run,
        "--metric",
        "score",
        "--keep-best-per-run",
        "0",
        "--keep-latest",
        "0",
        "--yes",
    )
    not_json = ckval(settings, "register", unique_run, str(released), "--metrics", "{nope")
    no_folder = ckval(settings, "register", unique_run, str(tmp_path / "nothing"))

    assert added.exit_code == 0 and "as report 5" in added.output, added.output
    assert gone.exit_code == 0 and "deleted 4" in gone.output, gone.output
    assert (released / "value.json").exists()
    kept = {c.report_index: c.uri for c in reg.checkpoints(unique_run)}
    assert kept[5] == str(released)
    assert not_json.exit_code == 2 and "--metrics is no JSON" in not_json.output
    assert no_folder.exit_code == 2 and "nothing there" in no_folder.output


def test_the_api_revalidates_within_the_allowed_modules_and_ranks_by_validator(
    reg, settings, tmp_path, unique_run
):
    reported_run(tmp_path, settings, reg, unique_run)
    open_settings = settings.model_copy(update={"service_name": "ckval-api-test-none"})
    modules_only = open_settings.model_copy(
        update={
            "allowed_modules": ["tests.test_revalidate", "validation_service.validators.command"]
        }
    )
    allowed = modules_only.model_copy(update={"allowed_commands": [sys.executable]})
    body = {"validator": "v2", "command": {"argv": program(tmp_path, PROGRAM)}}

    with TestClient(create_app(open_settings, reg), base_url="http://localhost") as client:
        refused = client.post(
            f"/runs/{unique_run}/revalidate",
            json={"validator": "v2", "validate_fn": "tests.test_revalidate:read_value"},
        )
    with TestClient(create_app(modules_only, reg), base_url="http://localhost") as client:
        no_program = client.post(f"/runs/{unique_run}/revalidate", json=body)
    with TestClient(create_app(allowed, reg), base_url="http://localhost") as client:
        queued = client.post(f"/runs/{unique_run}/revalidate", json=body)
        settle(reg, settings, queued.json()["job_ids"])
        again = client.post(f"/runs/{unique_run}/revalidate", json=body)
        outside = client.post(
            f"/runs/{unique_run}/revalidate", json={"validator": "x", "validate_fn": "os:system"}
        )
        both = client.post(
            f"/runs/{unique_run}/revalidate",
            json={**body, "validate_fn": "tests.test_revalidate:read_value"},
        )
        best = client.get(f"/runs/{unique_run}/best?metric=score&validator=v2&k=2")
        listed = client.get(f"/runs/{unique_run}/checkpoints")
        unknown = client.get(f"/runs/{unique_run}/best?metric=nope&validator=v2")

    assert refused.status_code == 403 and "CKVAL_ALLOWED_MODULES" in refused.json()["detail"]
    assert no_program.status_code == 403
    assert "CKVAL_ALLOWED_COMMANDS" in no_program.json()["detail"]
    assert queued.status_code == 200 and len(queued.json()["job_ids"]) == 5
    assert again.json() == {
        "job_ids": [],
        "already": [0, 1, 2, 3, 4],
        "deleted": [],
        "over_budget": [],
    }
    assert outside.status_code == 422 and "os:system" in outside.json()["detail"]
    assert both.status_code == 422
    assert [c["report_index"] for c in best.json()] == [3, 4]
    assert listed.json()[3]["evaluations"]["v2"] == {"score": 1.8, "exact": 1.0}
    assert unknown.status_code == 404


def test_revalidate_says_when_no_service_runs_to_take_the_jobs(reg, settings, tmp_path, unique_run):
    """A shell with no ckval service reachable (CKVAL_RAY_ADDRESS where nothing listens):
    the jobs are queued, and the command says at once that they wait for a service."""
    import os
    import subprocess
    import sys

    reported_run(tmp_path, settings, reg, unique_run)
    env = {
        **os.environ,
        "CKVAL_DATABASE_URL": settings.database_url,
        "CKVAL_STORAGE": settings.storage,
        "CKVAL_RAY_ADDRESS": "127.0.0.1:1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "validation_service.cli",
            "revalidate",
            unique_run,
            "--validator",
            "later",
            "--validate-fn",
            "tests.test_revalidate:read_value",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    assert "queued 5 job(s) of validator 'later'" in done.stdout
    assert "no ckval service is running" in done.stderr and "ckval serve" in done.stderr
    assert [j.status for j in reg.validations(unique_run) if j.validator == "later"] == [
        "QUEUED"
    ] * 5
