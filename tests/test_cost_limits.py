"""Documented caps on what one request may ask of the database (search terms, order
keys, IN lists, metrics per run page: a 422 naming the cap), and a run page whose data
grows linearly with its checkpoints and the metrics it shows (the rest counted and named)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.test_fuzz_inputs import RUN, populate
from validation_service.api import create_app
from validation_service.api.dashboard import data
from validation_service.config import Settings
from validation_service.registry import search
from validation_service.registry.records import CheckpointRecord, JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

REQUEST = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
)


@pytest.fixture
def api(registry, tmp_path):
    url = registry.engine.url.render_as_string(hide_password=False)
    config = Settings(database_url=url, namespace=f"cost-{uuid.uuid4().hex[:6]}", home=tmp_path)
    own = Registry(settings=config)
    populate(own, tmp_path)
    with TestClient(create_app(config, own), base_url="http://localhost") as client:
        yield client
    own.close()


def test_too_many_search_terms_are_a_422_naming_the_cap(api):
    terms = " and ".join(f"metrics.m{i} > 0" for i in range(search.MAX_TERMS + 1))
    answer = api.get("/search", params={"filter": terms})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_TERMS}" in answer.json()["detail"]
    allowed = " and ".join(f"metrics.acc > {i / 100}" for i in range(search.MAX_TERMS))
    assert api.get("/search", params={"filter": allowed}).status_code == 200


def test_too_many_order_keys_are_a_422_naming_the_cap(api):
    keys = [f"metrics.m{i} DESC" for i in range(search.MAX_ORDER_KEYS + 1)]
    answer = api.get("/search", params={"order_by": keys})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_ORDER_KEYS}" in answer.json()["detail"]


def test_too_long_an_in_list_is_a_422_naming_the_cap(api):
    values = ", ".join(f"'v{i}'" for i in range(search.MAX_IN_VALUES + 1))
    answer = api.get("/search", params={"filter": f"tags.split IN ({values})"})
    assert answer.status_code == 422, answer.text
    assert f"at most {search.MAX_IN_VALUES}" in answer.json()["detail"]


def _checkpoint(index: int, metrics: dict) -> CheckpointRecord:
    """A run page's checkpoint as the registry returns it (only what series read)."""
    fields = {name: None for name in CheckpointRecord.__dataclass_fields__}
    fields.update(
        report_index=index,
        reported_metrics=metrics,
        validated_metrics={},
        metrics=metrics,
        evaluations={},
    )
    return CheckpointRecord(**fields)


def test_the_run_pages_series_are_capped_and_the_rest_counted():
    metrics = {f"m{i:04d}": float(i) for i in range(1000)}
    checkpoints = [_checkpoint(i, metrics) for i in range(20)]

    names = data.metric_names(checkpoints)
    series = data.series_by_metric(checkpoints)

    assert names == sorted(metrics) and len(names) == 1000
    assert list(series) == names[: data.METRICS_PER_PAGE]
    assert series["m0003"]["reported"] == [3.0] * 20


def test_the_run_page_says_how_many_metrics_it_leaves_unplotted(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    populate(registry, tmp_path)
    page = data.run_json(registry.dashboard, RUN, "/ui")
    registry.close()
    assert page["metrics_total"] == 2 and set(page["series"]) == {"acc", "step"}


def test_more_metrics_per_run_page_than_the_cap_is_a_422_naming_it(api):
    url = f"/ui/api/runs/{RUN}"
    cap = data.MAX_METRICS_PER_PAGE
    too_many = api.get(url, params={"max_metrics": cap + 1})
    assert too_many.status_code == 422, too_many.text
    assert f"at most {cap} metrics" in too_many.json()["detail"]
    assert "metric=NAME" in too_many.json()["detail"]
    named = [("metric", f"m{i}") for i in range(cap + 1)]
    too_many_named = api.get(url, params=named)
    assert too_many_named.status_code == 422, too_many_named.text
    assert f"names {cap + 1} metrics" in too_many_named.json()["detail"]
    page = api.get(f"/ui/runs/{RUN}", params={"max_metrics": 0})
    assert page.status_code == 422 and f"at most {cap} metrics" in page.text
    assert api.get(url, params={"max_metrics": cap}).status_code == 200


WIDE = [f"m{i:03d}" for i in range(120)]


@pytest.fixture
def wide_run(api):
    """A run of 3 checkpoints that reported 120 metrics each, and one text value; the
    first one's validation returned the 120 metrics again."""
    registry = api.app.state.registry
    run_id = registry.ledger.ensure_run("wide", storage_root="/nowhere")
    for index in range(3):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/nowhere/wide/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={name: float(index) for name in WIDE} | {"phase": "warmup"},
            job=REQUEST if index == 0 else None,
        )
    [job] = registry.job_queue.claim_due_jobs("test", {"CPU": 1}, lease_s=60)
    validated = JobOutcome(succeeded=True, metrics={name: 9.0 for name in WIDE})
    assert registry.job_queue.finish_job(job.job_id, job.lease_token, validated)
    return "/ui/api/runs/wide"


def test_the_run_data_counts_every_metric_and_names_those_it_omits(api, wide_run):
    page = api.get(wide_run).json()
    shown = WIDE[: data.METRICS_PER_PAGE]
    assert page["metrics_total"] == len(WIDE) + 1
    assert page["metrics_shown"] == shown and list(page["series"]) == shown
    assert page["metrics_omitted"] == [*WIDE[data.METRICS_PER_PAGE :], "phase"]
    # Each checkpoint and job carries the values of the metrics shown only.
    assert [list(c["metrics"]) for c in page["checkpoints"]] == [shown] * 3
    assert list(page["checkpoints"][0]["validated_metrics"]) == shown
    assert [list(job["result_metrics"]) for job in page["jobs"]] == [shown]
    assert page["metrics_cap"] == data.MAX_METRICS_PER_PAGE

    every = api.get(wide_run, params={"max_metrics": 500}).json()
    assert every["metrics_shown"] == [*WIDE, "phase"] and every["metrics_omitted"] == []
    assert list(every["series"]) == WIDE  # the text value is in the table, not plotted


def test_the_run_data_shows_the_metrics_it_is_asked_for(api, wide_run):
    asked = [("metric", "m100"), ("metric", "phase"), ("metric", "nope"), ("metric", "m100")]
    page = api.get(wide_run, params=asked).json()
    assert page["metrics_shown"] == ["m100", "phase"]
    assert page["metrics_not_found"] == ["nope"]
    assert len(page["metrics_omitted"]) == len(WIDE) - 1
    assert list(page["series"]) == ["m100"]
    assert page["checkpoints"][2]["metrics"] == {"m100": 2.0, "phase": "warmup"}
    assert page["checkpoints"][2]["reported_metrics"] == {"m100": 2.0, "phase": "warmup"}


def test_security_md_states_the_caps_the_code_applies():
    text = (Path(__file__).resolve().parents[1] / "SECURITY.md").read_text()
    caps = text[text.index("**Cost of one request.**") :]
    for stated in (
        f"at most {search.MAX_TERMS} terms",
        f"at most {search.MAX_IN_VALUES} values",
        f"at most {search.MAX_ORDER_KEYS} keys",
        f"at most {data.MAX_METRICS_PER_PAGE} metrics per request",
        f"the first {data.METRICS_PER_PAGE} the run reported",
    ):
        assert stated in caps, stated


def test_json_columns_skip_the_non_finite_walk_only_when_there_is_none():
    from validation_service.registry._engine import json_dumps, json_loads

    stored = json_dumps({"loss": [math.nan, math.inf, -math.inf], "acc": 0.5, "note": "NaNs"})
    for raw in (stored, stored.encode()):  # SQLite gives text, psycopg bytes
        decoded = json_loads(raw)
        assert math.isnan(decoded["loss"][0]) and decoded["loss"][1:] == [math.inf, -math.inf]
        assert decoded["acc"] == 0.5 and decoded["note"] == "NaNs"
    assert json_loads(b'{"acc": 0.5, "phase": "warmup"}') == {"acc": 0.5, "phase": "warmup"}


def test_benchmark_run_page_smoke(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_run_page.py", "--smoke", "--backends", "sqlite"],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "CKVAL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sqlite |")]
    assert len(rows) == 4  # data and page, by default and with max_metrics=500
