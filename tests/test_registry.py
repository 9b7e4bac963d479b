"""Registry unit tests, each on SQLite and on PostgreSQL."""

from __future__ import annotations

import datetime as dt
import math
import threading

import pytest
from sqlalchemy import update

from tests.registry_world import delete_checkpoint
from validation_service.errors import InvalidInput, RunNotFound, UnknownMetric
from validation_service.jobs import JobStatus, ValidationStatus
from validation_service.registry._migrate import head_revision
from validation_service.registry.models import Checkpoint, MetricValue, utcnow
from validation_service.registry.records import JobOutcome
from validation_service.request import ValidationRequest

OWNER = "test-scheduler"


def spec(**overrides) -> ValidationRequest:
    values = dict(
        executor_kind="ray_task",
        pool="CPU",
        validate_fn_name="validate",
        validate_fn_ref="json:dumps",
        max_attempts=3,
    )
    values.update(overrides)
    return ValidationRequest(**values)


def register(registry, run_id, index, metrics, job=True, **job_overrides):
    return registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"/ckpts/{run_id}/{index}",
        size_bytes=10,
        manifest_sha256=None,
        reported_metrics=metrics,
        job=spec(**job_overrides) if job else None,
    )


def claim_one(registry, pools=None, lease_s=60.0):
    claimed = registry.job_queue.claim_due_jobs(OWNER, pools or {}, lease_s=lease_s)
    assert len(claimed) == 1, claimed
    return claimed[0]


def succeed(registry, claimed, metrics):
    return registry.job_queue.finish_job(
        claimed.job_id, claimed.lease_token, JobOutcome(succeeded=True, metrics=metrics)
    )


@pytest.fixture
def run_id(registry):
    return registry.ledger.ensure_run("run-a", storage_root="/ckpts")


def test_schema_is_created_by_migrations_and_round_trips(registry):
    assert registry.schema_revision() == head_revision(registry.url)
    registry.downgrade("base")
    assert registry.schema_revision() is None
    registry.upgrade()
    assert registry.schema_revision() == head_revision(registry.url)
    assert registry.ledger.ensure_run("after-upgrade", storage_root="/x") >= 1


def test_ensure_run_is_idempotent_and_checks_names(registry):
    first = registry.ledger.ensure_run("r", storage_root="/x")
    assert registry.ledger.ensure_run("r", storage_root="/x") == first
    assert [r.name for r in registry.runs()] == ["r"]
    for bad in ["", "a/b", "..", "x" * 300]:
        with pytest.raises(InvalidInput, match="run name"):
            registry.ledger.ensure_run(bad, storage_root="/x")
    assert [r.name for r in registry.runs()] == ["r"]


def test_enqueue_is_idempotent_per_run_and_report_index(registry, run_id):
    first = register(registry, run_id, 0, {"loss": 1.0})
    again = register(registry, run_id, 0, {"loss": 2.0})
    assert first.created and not again.created
    assert (again.checkpoint_id, again.job_id) == (first.checkpoint_id, first.job_id)
    [checkpoint] = registry.checkpoints("run-a")
    assert checkpoint.reported_metrics == {"loss": 1.0}
    assert registry.job_counts("run-a") == {"QUEUED": 1}


def test_job_state_transitions_to_succeeded(registry, run_id):
    registration = register(registry, run_id, 0, {"loss": 1.0})
    [job] = registry.validations("run-a")
    assert (job.status, job.attempts, job.lease_token) == ("QUEUED", 0, 0)
    assert registry.checkpoints("run-a")[0].validation_status == ValidationStatus.PENDING.value

    claimed = claim_one(registry)
    assert (claimed.job_id, claimed.attempt, claimed.lease_token) == (registration.job_id, 1, 1)
    [job] = registry.validations("run-a")
    assert (job.status, job.lease_owner) == ("RUNNING", OWNER)
    assert registry.checkpoints("run-a")[0].validation_status == "RUNNING"
    assert registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60) == []  # nothing else is due

    assert succeed(registry, claimed, {"accuracy": 0.9})
    [job] = registry.validations("run-a")
    assert job.status == JobStatus.SUCCEEDED.value
    assert job.result_metrics == {"accuracy": 0.9}
    assert job.finished_at is not None and job.lease_owner is None
    assert [a.status for a in job.attempt_history] == ["SUCCEEDED"]
    assert registry.checkpoints("run-a")[0].validation_status == "VALIDATED"


def test_checkpoint_without_validate_fn_has_no_job(registry, run_id):
    register(registry, run_id, 0, {"loss": 1.0}, job=False)
    assert registry.checkpoints("run-a")[0].validation_status == ValidationStatus.NONE.value
    assert registry.validations("run-a") == []
    registry.wait("run-a", timeout_s=1)  # nothing pending: returns at once


def test_only_the_current_lease_token_finishes_a_job(registry, run_id):
    register(registry, run_id, 0, {"loss": 1.0})
    first = claim_one(registry, lease_s=60)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120)
    assert registry.job_queue.requeue_expired(now=later) == [first.job_id]
    [job] = registry.validations("run-a")
    assert (job.status, job.attempts) == ("QUEUED", 1)

    second = claim_one(registry)
    assert second.lease_token == first.lease_token + 1 and second.attempt == 2
    # The orphaned first attempt reports late: discarded, nothing merged.
    assert not succeed(registry, first, {"accuracy": 0.1})
    assert registry.checkpoints("run-a")[0].validated_metrics is None
    assert succeed(registry, second, {"accuracy": 0.8})
    # The same token finishing again (a finish retried after its lost COMMIT) answers
    # done and changes nothing.
    assert succeed(registry, second, {"accuracy": 0.7})
    [checkpoint] = registry.checkpoints("run-a")
    assert checkpoint.validated_metrics == {"accuracy": 0.8}
    [job] = registry.validations("run-a")
    assert [a.status for a in job.attempt_history] == ["FAILED", "SUCCEEDED"]
    assert "expired" in job.attempt_history[0].error_message


def test_heartbeat_extends_held_leases_and_reports_lost_ones(registry, run_id):
    register(registry, run_id, 0, {})
    register(registry, run_id, 1, {})
    a, b = registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=5)
    registry.cancel_jobs([b.job_id])
    held = registry.job_queue.heartbeat(
        OWNER, [(a.job_id, a.lease_token), (b.job_id, b.lease_token)], lease_s=600
    )
    assert held == {a.job_id}
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60)
    assert registry.job_queue.requeue_expired(now=soon) == []  # the extended lease has not run out


def test_validated_metrics_overwrite_reported_and_both_are_kept(registry, run_id):
    register(registry, run_id, 0, {"loss": 1.0, "accuracy": 0.5})
    succeed(registry, claim_one(registry), {"accuracy": 0.9, "f1": 0.8})
    [c] = registry.checkpoints("run-a")
    assert c.metrics == {"loss": 1.0, "accuracy": 0.9, "f1": 0.8}
    assert c.reported_metrics == {"loss": 1.0, "accuracy": 0.5}
    assert c.validated_metrics == {"accuracy": 0.9, "f1": 0.8}
    [(_, metrics)] = registry.best_checkpoints("run-a", "accuracy", "max", k=1)
    assert metrics["accuracy"] == 0.9
    # The overridden reported value is never ranked: min gives the validated one too.
    [(_, metrics)] = registry.best_checkpoints("run-a", "accuracy", "min", k=5)
    assert metrics["accuracy"] == 0.9


def test_best_k_modes_ties_and_k_larger_than_count(registry, run_id):
    values = [0.5, 0.9, 0.7, 0.9, 0.1]
    for index, value in enumerate(values):
        register(registry, run_id, index, {"score": value}, job=False)
    top = registry.best_checkpoint_records("run-a", "score", "max", k=3)
    assert [(r.report_index, r.metrics["score"]) for r in top] == [(1, 0.9), (3, 0.9), (2, 0.7)]
    bottom = registry.best_checkpoint_records("run-a", "score", "min", k=2)
    assert [r.report_index for r in bottom] == [4, 0]
    assert len(registry.best_checkpoints("run-a", "score", k=50)) == len(values)
    checkpoint, metrics = registry.best_checkpoints("run-a", "score")[0]
    assert checkpoint.path.endswith(f"/{run_id}/1") and metrics == {"score": 0.9}


def test_nan_inf_and_missing_metrics_are_stored_but_never_ranked(registry, run_id):
    register(registry, run_id, 0, {"acc": math.nan}, job=False)
    register(registry, run_id, 1, {"acc": math.inf}, job=False)
    register(registry, run_id, 2, {"other": 1.0}, job=False)
    register(registry, run_id, 3, {"acc": 0.3}, job=False)
    register(registry, run_id, 4, {"acc": "n/a"}, job=False)
    ranked = registry.best_checkpoint_records("run-a", "acc", "max", k=10)
    assert [r.report_index for r in ranked] == [3]
    stored = {c.report_index: c.metrics for c in registry.checkpoints("run-a")}
    assert math.isnan(stored[0]["acc"]) and stored[1]["acc"] == math.inf
    assert stored[4]["acc"] == "n/a"


def test_nan_only_metric_gives_empty_result_not_unknown(registry, run_id):
    register(registry, run_id, 0, {"acc": math.nan}, job=False)
    assert registry.best_checkpoints("run-a", "acc") == []


def test_unknown_metric_and_unknown_run_are_clear_errors(registry, run_id):
    register(registry, run_id, 0, {"loss": 1.0}, job=False)
    with pytest.raises(UnknownMetric, match="'accuracy'.*Metrics recorded: loss"):
        registry.best_checkpoints("run-a", "accuracy")
    with pytest.raises(RunNotFound, match="'nope'.*Known runs: run-a"):
        registry.best_checkpoints("nope", "loss")
    with pytest.raises(RunNotFound):
        registry.checkpoints("nope")
    with pytest.raises(InvalidInput, match="mode"):
        registry.best_checkpoints("run-a", "loss", mode="biggest")
    with pytest.raises(InvalidInput, match="k must be"):
        registry.best_checkpoints("run-a", "loss", k=0)
    assert len(registry.checkpoints("run-a")) == 1


def test_metric_pending_validation_is_not_unknown(registry, run_id):
    register(registry, run_id, 0, {"loss": 1.0})
    assert registry.best_checkpoints("run-a", "accuracy") == []


def test_best_across_runs_of_the_namespace(registry, run_id):
    other = registry.ledger.ensure_run("run-b", storage_root="/ckpts")
    register(registry, run_id, 0, {"acc": 0.4}, job=False)
    register(registry, other, 0, {"acc": 0.6}, job=False)
    ranked = registry.best_checkpoint_records(None, "acc", "max", k=2)
    assert [(r.run, r.metrics["acc"]) for r in ranked] == [("run-b", 0.6), ("run-a", 0.4)]


def test_retryable_failure_backs_off_then_fails_with_reason(registry, run_id):
    register(registry, run_id, 0, {}, max_attempts=2)
    first = claim_one(registry)
    outcome = JobOutcome(
        succeeded=False,
        error_type="ValueError",
        error_message="boom",
        error_traceback="Traceback...\nValueError: boom",
        retryable=True,
    )
    assert registry.job_queue.finish_job(first.job_id, first.lease_token, outcome)
    [job] = registry.validations("run-a")
    assert job.status == "QUEUED" and job.not_before > dt.datetime.now(dt.timezone.utc)
    assert registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60) == []  # backing off

    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    with registry.engine.begin() as conn:  # let the backoff pass without sleeping
        from sqlalchemy import update

        from validation_service.registry.models import ValidationJob

        conn.execute(update(ValidationJob).values(not_before=soon - dt.timedelta(seconds=10)))
    second = claim_one(registry)
    assert registry.job_queue.finish_job(second.job_id, second.lease_token, outcome)
    [job] = registry.validations("run-a")
    assert (job.status, job.attempts, job.error_type) == ("FAILED", 2, "ValueError")
    assert "ValueError: boom" in job.error_traceback
    assert registry.checkpoints("run-a")[0].validation_status == "FAILED"
    registry.wait("run-a", timeout_s=1)


def test_permanent_failure_and_non_dict_result_fail_at_once(registry, run_id):
    register(registry, run_id, 0, {})
    register(registry, run_id, 1, {})
    a, b = registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60)
    registry.job_queue.finish_job(
        a.job_id,
        a.lease_token,
        JobOutcome(
            succeeded=False, error_type="CheckpointNotFound", error_message="gone", retryable=False
        ),
    )
    registry.job_queue.finish_job(
        b.job_id, b.lease_token, JobOutcome(succeeded=True, metrics=[0.9])
    )
    jobs = {j.report_index: j for j in registry.validations("run-a")}
    assert (jobs[0].status, jobs[0].attempts, jobs[0].error_type) == (
        "FAILED",
        1,
        "CheckpointNotFound",
    )
    assert jobs[1].status == "FAILED" and "must be a dict" in jobs[1].error_message


def test_timed_out_outcome(registry, run_id):
    register(registry, run_id, 0, {})
    claimed = claim_one(registry)
    registry.job_queue.finish_job(
        claimed.job_id,
        claimed.lease_token,
        JobOutcome(
            succeeded=False,
            error_type="TimeoutError",
            error_message="slow",
            retryable=False,
            timed_out=True,
        ),
    )
    [job] = registry.validations("run-a")
    assert job.status == "TIMED_OUT"
    assert registry.checkpoints("run-a")[0].validation_status == "TIMED_OUT"


def test_coalesce_latest_cancels_older_queued_jobs_only(registry, run_id):
    register(registry, run_id, 0, {})
    running = claim_one(registry)
    register(registry, run_id, 1, {})
    register(registry, run_id, 2, {})
    register(registry, run_id, 3, {}, coalesce="latest")
    jobs = {j.report_index: j for j in registry.validations("run-a")}
    assert {i: j.status for i, j in jobs.items()} == {
        0: "RUNNING",
        1: "CANCELLED",
        2: "CANCELLED",
        3: "QUEUED",
    }
    assert jobs[1].error_type == "Coalesced" and "report 3" in jobs[1].error_message
    statuses = [c.validation_status for c in registry.checkpoints("run-a")]
    assert statuses == ["RUNNING", "CANCELLED", "CANCELLED", "PENDING"]
    assert succeed(registry, running, {"m": 1.0})


def test_timeout_is_retried_only_when_asked(registry, run_id):
    timed_out = JobOutcome(
        succeeded=False,
        error_type="TimeoutError",
        error_message="slow",
        retryable=False,
        timed_out=True,
    )
    register(registry, run_id, 0, {}, retry_on_timeout=True, max_attempts=2)
    register(registry, run_id, 1, {}, max_attempts=2)
    for claimed in registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60):
        registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, timed_out)
    jobs = {j.report_index: j.status for j in registry.validations("run-a")}
    assert jobs == {0: "QUEUED", 1: "TIMED_OUT"}


def test_pool_limits_count_running_jobs_and_priority_orders_claims(registry, run_id):
    for index in range(4):
        register(registry, run_id, index, {}, pool="A10G", priority=index % 2)
    register(registry, run_id, 9, {}, pool="CPU")
    first = registry.job_queue.claim_due_jobs(OWNER, {"A10G": 2, "CPU": 1}, lease_s=60)
    by_pool = sorted((c.pool, c.report_index) for c in first)
    assert by_pool == [("A10G", 1), ("A10G", 3), ("CPU", 9)]  # priority 1 first
    assert registry.job_queue.claim_due_jobs(OWNER, {"A10G": 2, "CPU": 1}, lease_s=60) == []
    done = next(c for c in first if c.pool == "A10G")
    succeed(registry, done, {"m": 1.0})
    [again] = registry.job_queue.claim_due_jobs(OWNER, {"A10G": 2, "CPU": 1}, lease_s=60)
    assert again.pool == "A10G" and again.report_index in (0, 2)


def test_cancel_and_retry(registry, run_id):
    for index in range(3):
        register(registry, run_id, index, {})
    running = claim_one(registry, pools={"CPU": 1})
    cancelled = registry.cancel_jobs(run="run-a")
    assert len(cancelled) == 3
    assert registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60) == []
    assert not succeed(registry, running, {"m": 1.0})  # a cancelled attempt cannot finish
    assert registry.checkpoints("run-a")[0].validated_metrics is None
    assert registry.retry_jobs(run="run-a") == sorted(cancelled)
    assert registry.job_counts("run-a") == {"QUEUED": 3}
    assert len(registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60)) == 3
    with pytest.raises(InvalidInput):
        registry.cancel_jobs()


def test_cancel_closes_the_running_attempt_and_retry_grants_a_fresh_budget(registry, run_id):
    register(registry, run_id, 0, {}, max_attempts=1)
    running = claim_one(registry)
    registry.cancel_jobs([running.job_id])
    [job] = registry.validations("run-a")
    assert (job.status, job.error_type) == ("CANCELLED", "Cancelled")
    assert [(a.status, a.finished_at is not None) for a in job.attempt_history] == [
        ("CANCELLED", True)
    ]
    failure = JobOutcome(succeeded=False, error_type="ValueError", error_message="x")
    for round_ in range(3):
        registry.retry_jobs([running.job_id])
        [job] = registry.validations("run-a")
        assert (job.status, job.error_type, job.error_message) == ("QUEUED", None, None)
        again = claim_one(registry)
        registry.job_queue.finish_job(again.job_id, again.lease_token, failure)
        [job] = registry.validations("run-a")
        # max_attempts=1: each retry allows exactly one more attempt, no more.
        assert (job.status, job.attempts) == ("FAILED", round_ + 2)


def test_concurrent_claims_never_hand_out_a_job_twice(registry, run_id):
    for index in range(40):
        register(registry, run_id, index, {})
    claimed: list[int] = []
    lock = threading.Lock()

    def worker(name):
        while True:
            got = registry.job_queue.claim_due_jobs(name, {"CPU": 100}, lease_s=60, max_jobs=3)
            if not got:
                return
            with lock:
                claimed.extend(c.job_id for c in got)

    threads = [threading.Thread(target=worker, args=(f"s{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(claimed) == 40 and len(set(claimed)) == 40


def test_wait_times_out_with_a_clear_message(registry, run_id):
    register(registry, run_id, 0, {})
    with pytest.raises(TimeoutError, match="run-a"):
        registry.wait("run-a", timeout_s=0.2)
    with pytest.raises(RunNotFound):
        registry.wait("nope", timeout_s=0.2)


def test_bad_metrics_are_refused_and_nothing_is_stored(registry, run_id):
    register(registry, run_id, 0, {"ok": 1.0}, job=False)
    with pytest.raises(InvalidInput, match="at most 1000"):
        register(registry, run_id, 1, {f"m{i}": 1.0 for i in range(1001)}, job=False)
    with pytest.raises(InvalidInput, match="non-empty str"):
        register(registry, run_id, 1, {3: 1.0}, job=False)
    with pytest.raises(InvalidInput, match="JSON"):
        register(registry, run_id, 1, {"x": object()}, job=False)
    assert [c.report_index for c in registry.checkpoints("run-a")] == [0]


def test_deleted_checkpoint_is_never_ranked(registry, run_id):
    a = register(registry, run_id, 0, {"acc": 0.9}, job=False)
    register(registry, run_id, 1, {"acc": 0.5}, job=False)
    delete_checkpoint(registry, a.checkpoint_id)
    assert [r.report_index for r in registry.best_checkpoint_records("run-a", "acc", k=5)] == [1]
    assert len(registry.checkpoints("run-a", include_deleted=True)) == 2


def test_a_checkpoint_deleted_while_it_is_validated_stays_unranked(registry, run_id):
    deleted = register(registry, run_id, 0, {"acc": 0.9, "loss": 0.1})
    register(registry, run_id, 1, {"acc": 0.5, "loss": 0.2}, job=False)
    claimed = claim_one(registry)
    # Retention never deletes a checkpoint in flight: a row deleted by hand (or by an
    # older service) while its validation runs must still never be ranked again.
    with registry.db.write() as conn:
        conn.execute(
            update(Checkpoint)
            .where(Checkpoint.id == deleted.checkpoint_id)
            .values(deleted_at=utcnow())
        )
        conn.execute(
            update(MetricValue)
            .where(MetricValue.checkpoint_id == deleted.checkpoint_id)
            .values(effective=False)
        )
    assert succeed(registry, claimed, {"acc": 0.99})
    for metric, mode in (("acc", "max"), ("loss", "min")):
        records = registry.best_checkpoint_records("run-a", metric, mode, k=5)
        assert [r.report_index for r in records] == [1]
    [record] = [r for r in registry.checkpoints("run-a", include_deleted=True) if r.deleted_at]
    assert record.metrics == {"acc": 0.99, "loss": 0.1}
    assert record.validation_status == ValidationStatus.VALIDATED.value


def test_due_pools_lists_each_pool_with_due_work_once(registry, run_id):
    assert registry.job_queue.due_pools() == []
    for index in range(5):
        register(registry, run_id, index, {"loss": 0.1}, pool="CPU")
    register(registry, run_id, 5, {}, pool="A10G")
    register(registry, run_id, 6, {}, pool="GPU")
    assert sorted(registry.job_queue.due_pools()) == ["A10G", "CPU", "GPU"]
    # A pool whose only queued job is backing off has no due work; a claimed one none left.
    from sqlalchemy import update

    from validation_service.registry.models import ValidationJob

    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    with registry.engine.begin() as conn:
        conn.execute(
            update(ValidationJob).where(ValidationJob.pool == "GPU").values(not_before=later)
        )
    claim_one(registry, pools={"A10G": 1, "CPU": 0, "GPU": 0})
    assert registry.job_queue.due_pools() == ["CPU"]
    assert sorted(registry.job_queue.due_pools(now=later + dt.timedelta(seconds=1))) == [
        "CPU",
        "GPU",
    ]
