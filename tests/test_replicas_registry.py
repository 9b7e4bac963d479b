"""What replicas on one PostgreSQL registry rely on, without Ray: a pool's cap holds across
claimers, the fence holds between a finish's check and its write, a report wakes a
listening replica, and each replica's row says who serves the queue."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import sqlalchemy as sa

from validation_service.config import Settings
from validation_service.jobs import JobStatus
from validation_service.registry import queue as queue_module
from validation_service.registry import transitions
from validation_service.registry.records import JobOutcome
from validation_service.registry.registry import Registry
from validation_service.registry.replicas import replica_name
from validation_service.registry.wakeups import QueueListener
from validation_service.request import ValidationRequest


def register(registry: Registry, run_id: int, index: int) -> int:
    request = ValidationRequest(
        executor_kind="ray_task",
        pool="CPU",
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
    )
    return registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"/ckpts/{index}",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"loss": float(index)},
        job=request,
    ).job_id


@pytest.fixture
def postgres_registry(registry):
    if registry.db.dialect != "postgresql":
        pytest.skip("replicas claim from PostgreSQL")
    return registry


@pytest.mark.parametrize("registry", ["postgresql"], indirect=True)
def test_a_pools_cap_holds_across_replicas_claiming_at_once(postgres_registry, monkeypatch):
    registry = postgres_registry
    other = Registry(registry.url)
    run_id = registry.ledger.ensure_run("capped", storage_root="/ckpts")
    for index in range(10):
        register(registry, run_id, index)
    # The first claimer keeps its transaction open after it picked its jobs, so the second
    # counts the pool's running jobs while the first one's claim is not committed.
    first_picked = threading.Event()
    lock_due = queue_module.lock_due_job_ids

    def slow_lock(conn, pool, now, limit, background_limit):
        ids = lock_due(conn, pool, now, limit, background_limit)
        if threading.current_thread().name == "first":
            first_picked.set()
            time.sleep(1.0)
        return ids

    monkeypatch.setattr(queue_module, "lock_due_job_ids", slow_lock)
    claims: dict[str, list] = {}

    def claim(name: str, reg: Registry) -> None:
        claims[name] = reg.job_queue.claim_due_jobs(f"{name}/1", {"CPU": 2}, lease_s=60)

    first = threading.Thread(target=claim, args=("first", registry), name="first")
    first.start()
    assert first_picked.wait(10)
    claim("second", other)
    first.join()
    other.close()

    assert len(claims["first"]) == 2
    assert claims["second"] == []
    assert registry.job_counts("capped")[JobStatus.RUNNING.value] == 2


@pytest.mark.parametrize("registry", ["postgresql"], indirect=True)
def test_a_lease_expiring_while_its_result_is_written_is_not_taken_over(postgres_registry):
    registry = postgres_registry
    run_id = registry.ledger.ensure_run("fenced", storage_root="/ckpts")
    job_id = register(registry, run_id, 0)
    [claimed] = registry.job_queue.claim_due_jobs("slow/1", {}, lease_s=0.01)
    time.sleep(0.05)  # the lease ran out; the holder is writing its result nonetheless
    expired: list[list[int]] = []
    with registry.db.write() as conn:
        job = transitions.running_job(conn, job_id, claimed.lease_token)
        assert job is not None
        # Another replica's expiry scan meanwhile: it must wait for this write, then see
        # the job finished; without the row lock it would requeue the job under the
        # holder's feet and the result below would overwrite the requeued job.
        scan = threading.Thread(
            target=lambda: expired.append(registry.job_queue.requeue_expired()), daemon=True
        )
        scan.start()
        scan.join(timeout=1.0)
        assert scan.is_alive(), "the expiry scan did not wait for the row being finished"
        transitions.finish(
            conn,
            job,
            JobOutcome(succeeded=True, metrics={"acc": 1.0}),
            JobStatus.SUCCEEDED,
            dt.datetime.now(dt.timezone.utc),
            result_metrics={"acc": 1.0},
        )
    scan.join(timeout=30)
    assert expired == [[]]
    [record] = registry.validations("fenced")
    assert record.status == JobStatus.SUCCEEDED.value
    assert [a.status for a in record.attempt_history] == ["SUCCEEDED"]


@pytest.mark.parametrize("registry", ["postgresql"], indirect=True)
def test_a_stale_token_is_refused_after_a_takeover(postgres_registry):
    registry = postgres_registry
    run_id = registry.ledger.ensure_run("taken-over", storage_root="/ckpts")
    job_id = register(registry, run_id, 0)
    [stale] = registry.job_queue.claim_due_jobs("paused/1", {}, lease_s=0.01)
    time.sleep(0.05)
    assert registry.job_queue.requeue_expired() == [job_id]
    [fresh] = registry.job_queue.claim_due_jobs("other/1", {}, lease_s=60)
    assert fresh.lease_token != stale.lease_token

    late = JobOutcome(succeeded=True, metrics={"a": 0.0})
    assert not registry.job_queue.finish_job(job_id, stale.lease_token, late)
    assert registry.job_queue.heartbeat("paused/1", [(job_id, stale.lease_token)], lease_s=60) == (
        set()
    )
    on_time = JobOutcome(succeeded=True, metrics={"a": 1.0})
    assert registry.job_queue.finish_job(job_id, fresh.lease_token, on_time)
    [record] = registry.validations("taken-over")
    assert record.result_metrics == {"a": 1.0}
    assert [a.status for a in record.attempt_history] == ["FAILED", "SUCCEEDED"]


@pytest.mark.parametrize("registry", ["postgresql"], indirect=True)
def test_a_report_wakes_a_listening_replica_and_a_lost_connection_comes_back(
    postgres_registry,
):
    registry = postgres_registry
    woken = threading.Event()
    listener = QueueListener(registry.engine, woken.set).start()
    try:
        assert listener.connected.wait(10)
        woken.clear()
        run_id = registry.ledger.ensure_run("woken", storage_root="/ckpts")
        register(registry, run_id, 0)
        assert woken.wait(5), "no wake-up after a report"
        assert listener.notifications >= 1

        with registry.engine.connect() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE query = 'LISTEN ckval_jobs'"
                )
            ).scalar_one()
        assert killed >= 1
        deadline = time.monotonic() + 30
        while listener.notifications and time.monotonic() < deadline:
            if not listener.connected.is_set():
                break
            time.sleep(0.05)
        assert listener.connected.wait(30), "the listener did not reconnect"
        before = listener.notifications
        register(registry, run_id, 1)
        deadline = time.monotonic() + 5
        while listener.notifications == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.notifications > before, "no wake-up after reconnecting"
    finally:
        listener.stop()


def test_sqlite_needs_no_listener(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    assert not QueueListener.applies_to(registry.engine)
    registry.close()


def test_replica_rows_say_who_serves_with_its_leases(registry):
    started = dt.datetime.now(dt.timezone.utc)
    for index in range(3):
        registry.replicas.beat(
            name=replica_name("svc", index),
            service_name="svc",
            owner=f"{replica_name('svc', index)}/host:{index}",
            pid=100 + index,
            hostname="host",
            node_id=f"node-{index}",
            started_at=started,
        )
    run_id = registry.ledger.ensure_run("leased", storage_root="/ckpts")
    register(registry, run_id, 0)
    registry.job_queue.claim_due_jobs("svc-replica-1/host:1", {}, lease_s=60)

    rows = registry.replicas.list("svc")
    assert [r.name for r in rows] == ["svc", "svc-replica-1", "svc-replica-2"]
    assert [r.leases for r in rows] == [0, 1, 0]
    assert all(r.fresh(lease_s=60) for r in rows)
    registry.replicas.stopped("svc-replica-2", "svc-replica-2/host:2")
    registry.replicas.forget("svc", keep=2)
    rows = registry.replicas.list("svc")
    assert [(r.name, r.stopped_at is None) for r in rows] == [
        ("svc", True),
        ("svc-replica-1", True),
    ]


def test_settings_default_to_one_replica():
    assert Settings().replicas == 1


def test_a_finish_retried_after_its_commit_counts_as_done_once(registry):
    # The connection can drop after the server committed a finish and before the answer
    # came back; retry_on_disconnect then runs the finish again with the same token.
    run_id = registry.ledger.ensure_run("retried-finish", storage_root="/ckpts")
    job_id = register(registry, run_id, 0)
    [claimed] = registry.job_queue.claim_due_jobs("svc/1", {}, lease_s=60)
    outcome = JobOutcome(succeeded=True, metrics={"acc": 0.5})
    assert registry.job_queue.finish_job(job_id, claimed.lease_token, outcome)
    assert registry.job_queue.finish_job(job_id, claimed.lease_token, outcome)
    failed = JobOutcome(succeeded=False, error_type="E", error_message="late", retryable=False)
    assert not registry.job_queue.finish_job(job_id, claimed.lease_token, failed)

    [record] = registry.validations("retried-finish")
    assert record.status == JobStatus.SUCCEEDED.value and record.result_metrics == {"acc": 0.5}
    assert [a.status for a in record.attempt_history] == ["SUCCEEDED"]
    [checkpoint] = registry.checkpoints("retried-finish")
    assert checkpoint.validated_metrics == {"acc": 0.5}


def test_claims_whose_answer_was_lost_are_released_by_their_owner(registry):
    run_id = registry.ledger.ensure_run("lost-claim", storage_root="/ckpts")
    ids = [register(registry, run_id, index) for index in range(3)]
    claimed = registry.job_queue.claim_due_jobs("svc/1", {}, lease_s=600)
    assert sorted(job.job_id for job in claimed) == ids
    # The scheduler launched the first; the answer naming the other two never arrived.
    assert registry.job_queue.release_unlaunched("svc/1", [ids[0]]) == ids[1:]
    assert registry.job_queue.release_unlaunched("svc/1", [ids[0]]) == []
    statuses = {job.id: job.status for job in registry.validations("lost-claim")}
    assert statuses == {ids[0]: "RUNNING", ids[1]: "QUEUED", ids[2]: "QUEUED"}
