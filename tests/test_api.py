"""HTTP API over a real SQLite registry: listings, best-k, errors, cancel and retry."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from validation_service.api import create_app
from validation_service.config import Settings
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

SPEC = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="f", validate_fn_ref="json:dumps"
)


@dataclasses.dataclass
class World:
    """A registry with three runs whose jobs are in known states, and a client on it."""

    client: TestClient
    registry: Registry
    jobs: dict[str, list[int]]  # run name -> job id per report index


def _report(
    registry: Registry, tmp_path: Path, run: str, reported: list[dict[str, float]]
) -> list[int]:
    run_id = registry.ledger.ensure_run(run, storage_root=str(tmp_path))
    job_ids = []
    for index, metrics in enumerate(reported):
        registration = registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{tmp_path}/{run}/checkpoint_{index:06d}",
            size_bytes=1000 + index,
            manifest_sha256=None,
            reported_metrics=metrics,
            step=10 * index,
            epoch=index,
            job=SPEC,
        )
        job_ids.append(registration.job_id)
    return job_ids


def _finish(registry: Registry, outcomes: dict[int, JobOutcome]) -> None:
    """Claims every due job as a scheduler would and records the given outcomes."""
    claimed = registry.job_queue.claim_due_jobs("test-owner", {"CPU": 100}, lease_s=60)
    tokens = {job.job_id: job.lease_token for job in claimed}
    for job_id, outcome in outcomes.items():
        assert registry.job_queue.finish_job(job_id, tokens[job_id], outcome)


def _validated(metrics: dict[str, float]) -> JobOutcome:
    now = dt.datetime.now(dt.timezone.utc)
    return JobOutcome(
        succeeded=True, metrics=metrics, node_id="node-a", started_at=now, finished_at=now
    )


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    registry = Registry(f"sqlite:///{tmp_path}/r.db")
    jobs = {
        "alpha": _report(
            registry,
            tmp_path,
            "alpha",
            [
                {"loss": 0.9},
                {"loss": 0.5, "grad_norm": math.inf},
                {"loss": 0.7, "grad_norm": -math.inf},
                {"loss": math.nan},
            ],
        ),
        "beta": _report(registry, tmp_path, "beta", [{"loss": 0.4}]),
    }
    accuracies = [0.60, 0.80, 0.75, math.nan]
    outcomes = {
        job_id: _validated({"accuracy": accuracy})
        for job_id, accuracy in zip(jobs["alpha"], accuracies, strict=True)
    }
    outcomes[jobs["beta"][0]] = _validated({"accuracy": 0.90})
    _finish(registry, outcomes)
    # gamma: report 0 stays QUEUED, report 1 fails for good.
    jobs["gamma"] = _report(registry, tmp_path, "gamma", [{"loss": 1.0}, {"loss": 2.0}])
    failure = JobOutcome(
        succeeded=False,
        error_type="ValueError",
        error_message="bad checkpoint shape",
        error_traceback="Traceback (most recent call last):\nValueError: bad checkpoint shape",
        retryable=False,
        node_id="node-b",
    )
    claimed = registry.job_queue.claim_due_jobs("test-owner", {"CPU": 100}, lease_s=60)
    token = next(c.lease_token for c in claimed if c.job_id == jobs["gamma"][1])
    assert registry.job_queue.finish_job(jobs["gamma"][1], token, failure)
    # Put report 0 back in the queue as a fresh QUEUED job (cancel + retry via the registry).
    registry.cancel_jobs([jobs["gamma"][0]])
    registry.retry_jobs([jobs["gamma"][0]])
    assert registry.get_job(jobs["gamma"][0]).status == "QUEUED"

    # A service name no Ray cluster has: /service and the retry nudge never touch a real one.
    settings = Settings(service_name=f"ckval-api-test-{uuid.uuid4().hex[:8]}")
    # The API answers loopback Host names only (TestClient's default is "testserver").
    with TestClient(create_app(settings, registry), base_url="http://localhost") as client:
        yield World(client, registry, jobs)
    registry.close()


def test_healthz_says_only_ok(world: World):
    response = world.client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"ok": True}


def test_runs_list_status_tags_and_job_counts(world: World):
    runs = {run["name"]: run for run in world.client.get("/runs").json()}
    assert list(runs) == ["alpha", "beta", "gamma"]
    assert runs["alpha"]["namespace"] == "default"
    assert runs["alpha"]["status"] == "RUNNING"
    assert runs["alpha"]["tags"] == {}
    assert runs["alpha"]["jobs"]["SUCCEEDED"] == 4
    assert runs["alpha"]["jobs"]["QUEUED"] == 0
    assert runs["gamma"]["jobs"] == {
        "QUEUED": 1,
        "RUNNING": 0,
        "WAITING_FOR_RESOURCES": 0,
        "SUCCEEDED": 0,
        "FAILED": 1,
        "TIMED_OUT": 0,
        "CANCELLED": 0,
    }
    created = dt.datetime.fromisoformat(runs["alpha"]["created_at"])
    assert created.utcoffset() == dt.timedelta(0)


def test_checkpoints_render_merged_metrics_and_non_finite_values(world: World, tmp_path: Path):
    response = world.client.get("/runs/alpha/checkpoints")
    assert response.status_code == 200
    checkpoints = response.json()
    assert [c["report_index"] for c in checkpoints] == [0, 1, 2, 3]
    second = checkpoints[1]
    assert second["step"] == 10 and second["epoch"] == 1
    assert second["uri"] == f"{tmp_path}/alpha/checkpoint_000001"
    assert second["size_bytes"] == 1001
    assert second["validation_status"] == "VALIDATED"
    assert second["reported_metrics"] == {"loss": 0.5, "grad_norm": "Infinity"}
    assert second["validated_metrics"] == {"accuracy": 0.8}
    assert second["metrics"] == {"loss": 0.5, "grad_norm": "Infinity", "accuracy": 0.8}
    assert checkpoints[2]["metrics"]["grad_norm"] == "-Infinity"
    assert checkpoints[3]["metrics"] == {"loss": "NaN", "accuracy": "NaN"}
    assert dt.datetime.fromisoformat(second["created_at"]).tzinfo is not None


def test_best_of_run_ranks_by_max_and_min_skipping_nan(world: World):
    best = world.client.get("/runs/alpha/best", params={"metric": "accuracy", "k": 10}).json()
    assert [c["report_index"] for c in best] == [1, 2, 0]  # NaN (report 3) is never ranked
    assert [c["metrics"]["accuracy"] for c in best] == [0.8, 0.75, 0.6]

    lowest = world.client.get(
        "/runs/alpha/best", params={"metric": "loss", "mode": "min", "k": 2}
    ).json()
    assert [(c["report_index"], c["metrics"]["loss"]) for c in lowest] == [(1, 0.5), (2, 0.7)]

    one = world.client.get("/runs/alpha/best", params={"metric": "accuracy"}).json()
    assert [c["report_index"] for c in one] == [1]  # k defaults to 1, mode to max


def test_best_across_runs_of_the_namespace(world: World):
    best = world.client.get("/best", params={"metric": "accuracy", "k": 2}).json()
    assert [(c["run"], c["report_index"], c["metrics"]["accuracy"]) for c in best] == [
        ("beta", 0, 0.9),
        ("alpha", 1, 0.8),
    ]
    lowest = world.client.get("/best", params={"metric": "loss", "mode": "min"}).json()
    assert [(c["run"], c["metrics"]["loss"]) for c in lowest] == [("beta", 0.4)]


def test_validations_show_attempts_and_errors(world: World):
    jobs = {job["report_index"]: job for job in world.client.get("/runs/gamma/validations").json()}
    failed = jobs[1]
    assert failed["id"] == world.jobs["gamma"][1]
    assert failed["status"] == "FAILED"
    assert failed["error_type"] == "ValueError"
    assert failed["error_message"] == "bad checkpoint shape"
    assert failed["error_traceback"].endswith("ValueError: bad checkpoint shape")
    assert failed["attempt_count"] == 1
    [attempt] = failed["attempts"]
    assert attempt["status"] == "FAILED"
    assert attempt["node_id"] == "node-b"
    assert attempt["error"] == "bad checkpoint shape"
    assert attempt["finished_at"] is not None

    alpha = world.client.get("/runs/alpha/validations").json()
    assert [job["status"] for job in alpha] == ["SUCCEEDED"] * 4
    assert alpha[1]["result_metrics"] == {"accuracy": 0.8}
    assert alpha[3]["result_metrics"] == {"accuracy": "NaN"}
    assert alpha[1]["attempts"][0]["node_id"] == "node-a"
    assert alpha[1]["attempts"][0]["started_at"] is not None


def test_get_job(world: World):
    job_id = world.jobs["alpha"][2]
    job = world.client.get(f"/jobs/{job_id}").json()
    assert (job["id"], job["run"], job["report_index"]) == (job_id, "alpha", 2)
    assert job["status"] == "SUCCEEDED"
    assert job["pool"] == "CPU" and job["executor_kind"] == "ray_task"
    assert job["validate_fn_name"] == "f"


def test_unknown_run_job_and_metric_are_404_naming_what_was_wrong(world: World):
    for method, path in [
        ("get", "/runs/nope/checkpoints"),
        ("get", "/runs/nope/validations"),
        ("get", "/runs/nope/best?metric=accuracy"),
        ("post", "/runs/nope/cancel"),
        ("post", "/runs/nope/retry"),
    ]:
        response = world.client.request(method, path)
        assert response.status_code == 404, path
        body = response.json()
        assert body["error"] == "RunNotFound", path
        assert "'nope'" in body["detail"] and "alpha" in body["detail"], path

    for method, path in [
        ("get", "/jobs/987654"),
        ("post", "/jobs/987654/cancel"),
        ("post", "/jobs/987654/retry"),
    ]:
        response = world.client.request(method, path)
        assert response.status_code == 404, path
        assert response.json()["error"] == "JobNotFound", path
        assert "987654" in response.json()["detail"], path

    response = world.client.get("/runs/alpha/best", params={"metric": "f1"})
    assert response.status_code == 404
    body = response.json()
    assert body["error"] == "UnknownMetric"
    assert "'f1'" in body["detail"]
    assert "accuracy" in body["detail"] and "loss" in body["detail"]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"metric": "accuracy", "k": 0}, "k"),
        ({"metric": "accuracy", "k": "three"}, "k"),
        ({"metric": "accuracy", "mode": "foo"}, "mode"),
        ({}, "metric"),
    ],
)
def test_bad_query_parameters_are_422(world: World, params: dict, named: str):
    for path in ("/runs/alpha/best", "/best"):
        response = world.client.get(path, params=params)
        assert response.status_code == 422, (path, params)
        body = response.json()
        assert body["error"] == "InvalidInput"
        assert named in body["detail"]


def test_cancel_then_retry_one_job(world: World):
    job_id = world.jobs["gamma"][0]
    response = world.client.post(f"/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json() == {"jobs": [job_id]}
    assert world.client.get(f"/jobs/{job_id}").json()["status"] == "CANCELLED"
    checkpoint = world.client.get("/runs/gamma/checkpoints").json()[0]
    assert checkpoint["validation_status"] == "CANCELLED"

    # Cancelling again changes nothing: the job is no longer active.
    assert world.client.post(f"/jobs/{job_id}/cancel").json() == {"jobs": []}

    assert world.client.post(f"/jobs/{job_id}/retry").json() == {"jobs": [job_id]}
    assert world.client.get(f"/jobs/{job_id}").json()["status"] == "QUEUED"
    checkpoint = world.client.get("/runs/gamma/checkpoints").json()[0]
    assert checkpoint["validation_status"] == "PENDING"


def test_succeeded_jobs_are_neither_cancelled_nor_retried(world: World):
    job_id = world.jobs["alpha"][0]
    assert world.client.post(f"/jobs/{job_id}/cancel").json() == {"jobs": []}
    assert world.client.post(f"/jobs/{job_id}/retry").json() == {"jobs": []}
    assert world.client.get(f"/jobs/{job_id}").json()["status"] == "SUCCEEDED"


def test_cancel_then_retry_a_run(world: World):
    queued, failed = world.jobs["gamma"]
    assert world.client.post("/runs/gamma/cancel").json() == {"jobs": [queued]}
    statuses = [job["status"] for job in world.client.get("/runs/gamma/validations").json()]
    assert statuses == ["CANCELLED", "FAILED"]
    assert world.client.get("/runs").json()[2]["jobs"]["CANCELLED"] == 1

    assert sorted(world.client.post("/runs/gamma/retry").json()["jobs"]) == [queued, failed]
    statuses = [job["status"] for job in world.client.get("/runs/gamma/validations").json()]
    assert statuses == ["QUEUED", "QUEUED"]
    # Other runs are untouched.
    assert world.client.get("/runs").json()[0]["jobs"]["SUCCEEDED"] == 4


def test_service_is_503_without_a_running_service(world: World):
    # Ray is not started by these tests; if another test of the session started it, the
    # app's service name still matches no actor. Either way the answer is 503.
    response = world.client.get("/service")
    assert response.status_code == 503
    body = response.json()
    assert body["error"] == "ServiceUnavailable"
    assert "Ray is not initialized" in body["detail"] or "No ckval service" in body["detail"]


def test_unknown_route_keeps_the_error_shape(world: World):
    response = world.client.get("/no/such/route")
    assert response.status_code == 404
    assert response.json() == {"error": "NotFound", "detail": "Not Found"}
