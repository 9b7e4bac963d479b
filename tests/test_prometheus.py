"""/metrics over real SQLite and PostgreSQL registries, parsed as Prometheus parses it."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.registry_world import delete_checkpoint
from validation_service.api import create_app
from validation_service.api.dashboard.prometheus import RegistryCollector
from validation_service.config import Settings
from validation_service.jobs import JobStatus
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest

# A service name no Ray cluster has: nothing here reaches a real service.
SETTINGS = Settings(service_name="ckval-prometheus-test-none")


def _spec(pool: str) -> ValidationRequest:
    return ValidationRequest(
        executor_kind="ray_task", pool=pool, validate_fn_name="f", validate_fn_ref="json:dumps"
    )


def _report(registry: Registry, tmp_path: Path, run: str, pool: str, n: int) -> list[int]:
    run_id = registry.ledger.ensure_run(run, storage_root=str(tmp_path))
    return [
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"{tmp_path}/{run}/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"loss": 1.0 / (index + 1)},
            job=_spec(pool),
        ).job_id
        for index in range(n)
    ]


def _scrape(registry: Registry, settings: Settings = SETTINGS) -> dict[str, dict]:
    """Metric family name -> {(sample name, sorted labels): value}."""
    with TestClient(create_app(settings, registry), base_url="http://localhost") as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for sample in family.samples
        }
    return families


def _one(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    return families[family][(sample or family, tuple(sorted(labels.items())))]


@pytest.fixture
def busy(registry: Registry, tmp_path: Path) -> Registry:
    """Two pools with jobs SUCCEEDED, FAILED, RUNNING and QUEUED."""
    cpu = _report(registry, tmp_path, "cpu-run", "CPU", 5)
    gpu = _report(registry, tmp_path, "gpu-run", "A10G", 3)
    claimed = {
        c.job_id: c
        for c in registry.job_queue.claim_due_jobs("test", {"CPU": 3, "A10G": 2}, lease_s=60)
    }
    now = dt.datetime.now(dt.timezone.utc)
    done = JobOutcome(succeeded=True, metrics={"accuracy": 0.9}, started_at=now, finished_at=now)
    failed = JobOutcome(
        succeeded=False, error_type="ValueError", error_message="x", retryable=False
    )
    for job_id, outcome in ((cpu[0], done), (cpu[1], failed), (gpu[0], done)):
        assert registry.job_queue.finish_job(job_id, claimed[job_id].lease_token, outcome)
    # Left: cpu[2] and gpu[1] RUNNING under live leases, cpu[3], cpu[4], gpu[2] QUEUED.
    return registry


def test_jobs_by_status_and_pool_match_the_registry(busy: Registry):
    families = _scrape(busy)
    expected = Counter(
        (job.status, job.pool) for run in ("cpu-run", "gpu-run") for job in busy.validations(run)
    )
    reported = {
        (dict(labels)["status"], dict(labels)["pool"]): value
        for (_, labels), value in families["ckval_jobs"].items()
    }
    assert reported == {key: float(count) for key, count in expected.items()}
    assert expected[("QUEUED", "CPU")] == 2 and expected[("RUNNING", "A10G")] == 1
    assert sum(reported.values()) == sum(busy.job_counts().values()) == 8


def test_queue_depth_per_pool_counts_queued_jobs(busy: Registry):
    families = _scrape(busy)
    assert _one(families, "ckval_queue_depth", pool="CPU") == 2
    assert _one(families, "ckval_queue_depth", pool="A10G") == 1


def test_registrations_counter_keeps_deleted_checkpoints(busy: Registry):
    before = _one(
        _scrape(busy), "ckval_checkpoints_registered", "ckval_checkpoints_registered_total"
    )
    assert before == 8
    first = busy.checkpoints("cpu-run")[0]
    delete_checkpoint(busy, first.id)
    assert len(busy.checkpoints("cpu-run")) == 4
    after = _one(
        _scrape(busy), "ckval_checkpoints_registered", "ckval_checkpoints_registered_total"
    )
    assert after == before


def test_histograms_match_the_jobs_timestamps(busy: Registry):
    families = _scrape(busy)
    jobs = [job for run in ("cpu-run", "gpu-run") for job in busy.validations(run)]
    for pool in ("CPU", "A10G"):
        finished = [
            j
            for j in jobs
            if j.pool == pool and JobStatus(j.status).is_terminal and j.started_at is not None
        ]
        started = [j for j in jobs if j.pool == pool and j.started_at is not None]
        duration = families["ckval_validation_duration_seconds"]
        count = duration[("ckval_validation_duration_seconds_count", (("pool", pool),))]
        total = duration[("ckval_validation_duration_seconds_sum", (("pool", pool),))]
        assert count == len(finished)
        expected = sum((j.finished_at - j.started_at).total_seconds() for j in finished)
        # SQLite's date functions keep milliseconds: 1 ms per timestamp at most.
        assert total == pytest.approx(expected, abs=2e-3 * len(finished) + 1e-9)
        buckets = [
            (float(dict(labels)["le"]), value)
            for (name, labels), value in duration.items()
            if name.endswith("_bucket") and dict(labels)["pool"] == pool
        ]
        values = [value for _, value in sorted(buckets)]
        assert values == sorted(values) and values[-1] == count  # cumulative, +Inf = count
        latency = families["ckval_dispatch_latency_seconds"]
        assert latency[("ckval_dispatch_latency_seconds_count", (("pool", pool),))] == len(started)
        expected = sum((j.started_at - j.created_at).total_seconds() for j in started)
        assert latency[("ckval_dispatch_latency_seconds_sum", (("pool", pool),))] == pytest.approx(
            expected, abs=2e-3 * len(started) + 1e-9
        )


def test_service_up_while_a_scheduler_holds_live_leases(busy: Registry):
    families = _scrape(busy)
    assert _one(families, "ckval_leases", state="live") == 2
    assert _one(families, "ckval_service_up", source="registry") == 1
    assert _one(families, "ckval_registry_up") == 1


def test_service_up_on_an_idle_queue(registry: Registry, tmp_path: Path):
    _report(registry, tmp_path, "idle", "CPU", 0)
    families = _scrape(registry)
    assert _one(families, "ckval_service_up", source="registry") == 1
    assert _one(families, "ckval_oldest_due_job_age_seconds") == 0


def test_service_down_when_a_lease_expired_unnoticed(registry: Registry, tmp_path: Path):
    _report(registry, tmp_path, "lost", "CPU", 1)
    # A lease that ran out at once: the scheduler that took the job is gone.
    assert registry.job_queue.claim_due_jobs("gone", {"CPU": 1}, lease_s=-1.0)
    families = _scrape(registry)
    assert _one(families, "ckval_leases", state="expired") == 1
    assert _one(families, "ckval_service_up", source="registry") == 0


def test_service_down_when_due_jobs_wait_past_the_grace(registry: Registry, tmp_path: Path):
    _report(registry, tmp_path, "waiting", "CPU", 2)
    # A grace of 0 s: every due job that nobody claimed is overdue.
    families = _scrape(registry, SETTINGS.model_copy(update={"lease_s": 0.0}))
    assert _one(families, "ckval_queue_depth", pool="CPU") == 2
    assert _one(families, "ckval_oldest_due_job_age_seconds") >= 0
    assert _one(families, "ckval_service_up", source="registry") == 0


def _collect(collector: RegistryCollector) -> dict[str, dict]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        families[family.name] = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for sample in family.samples
        }
    return families


def _count(families: dict, family: str, pool: str) -> float:
    return families[family][(f"{family}_count", (("pool", pool),))]


def test_histograms_from_sql_totals_then_job_by_job_without_double_counting(
    busy: Registry, tmp_path: Path
):
    # No overlap: the first scrape buckets every job so far in SQL.
    collector = RegistryCollector(busy.dashboard, SETTINGS, overlap_s=0.0)
    first = _collect(collector)
    assert _count(first, "ckval_validation_duration_seconds", "CPU") == 2
    assert _count(first, "ckval_dispatch_latency_seconds", "CPU") == 3
    # A later scrape adds only what changed since: a CPU job ends, a new one is claimed.
    running = next(j for j in busy.validations("cpu-run") if j.status == "RUNNING")
    assert busy.job_queue.finish_job(running.id, running.lease_token, _done())
    claimed = busy.job_queue.claim_due_jobs("test", {"CPU": 10, "A10G": 0}, lease_s=60)
    assert len(claimed) == 2
    second = _collect(collector)
    assert _count(second, "ckval_validation_duration_seconds", "CPU") == 3
    assert _count(second, "ckval_dispatch_latency_seconds", "CPU") == 5
    # Scraping again counts nothing twice; a collector with the default overlap agrees.
    third = _collect(collector)
    for family in ("ckval_validation_duration_seconds", "ckval_dispatch_latency_seconds"):
        assert third[family] == second[family]
    fresh = _collect(RegistryCollector(busy.dashboard, SETTINGS))
    for family in ("ckval_validation_duration_seconds", "ckval_dispatch_latency_seconds"):
        for pool in ("CPU", "A10G"):
            assert _count(fresh, family, pool) == _count(second, family, pool)


def _done() -> JobOutcome:
    now = dt.datetime.now(dt.timezone.utc)
    return JobOutcome(succeeded=True, metrics={"accuracy": 0.5}, started_at=now, finished_at=now)


@pytest.mark.ray
def test_service_up_asks_the_service_actor_where_ray_runs(service):
    """Inside `ckval serve` Ray runs in the API's process: the actor itself answers."""
    from validation_service.config import get_settings

    settings = get_settings()
    registry = Registry(settings=settings)
    try:
        families = _scrape(registry, settings)
        assert _one(families, "ckval_service_up", source="actor") == 1
        # Another service name on the same cluster: no such actor here (it may run on
        # another cluster), so the registry's leases answer instead.
        absent = settings.model_copy(update={"service_name": "ckval-prometheus-test-none"})
        scraped = _scrape(registry, absent)
        assert ("ckval_service_up", (("source", "actor"),)) not in scraped["ckval_service_up"]
        assert _one(scraped, "ckval_service_up", source="registry") in (0, 1)
    finally:
        registry.close()
