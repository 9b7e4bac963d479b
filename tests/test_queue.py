"""The queue's named transitions, each on SQLite and on PostgreSQL: from which states it
applies, and what it writes (job, attempt rows, the checkpoint's mirrored status)."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from validation_service.jobs import JOB_TO_VALIDATION_STATUS, JobStatus, ValidationStatus
from validation_service.registry import transitions
from validation_service.registry.queue import LEASE_COLUMNS
from validation_service.registry.records import JobOutcome
from validation_service.request import ValidationRequest
from validation_service.retry import AttemptBudget, Decision, RetryPolicy

OWNER = "queue-test/1"
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


def request(**overrides) -> ValidationRequest:
    fields = {"executor_kind": "ray_task", "pool": "CPU", "validate_fn_name": "validate"}
    return ValidationRequest(**{**fields, "validate_fn_ref": "json:dumps", **overrides})


def register(registry, run_id, index, **overrides):
    return registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=f"/ckpts/{index}",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"loss": float(index)},
        job=request(**overrides),
    )


def claim_one(registry):
    [claimed] = registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60)
    return claimed


def fail(registry, claimed, **outcome):
    values = dict(succeeded=False, error_type="ValueError", error_message="bad", retryable=False)
    values.update(outcome)
    return registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, JobOutcome(**values))


@pytest.fixture
def run_id(registry):
    return registry.ledger.ensure_run("run-q", storage_root="/ckpts")


@pytest.fixture
def one_job_per_state(registry, run_id):
    """A job in each of the seven states; returns {status: job id}."""
    jobs = {}
    for index, status in enumerate(
        [
            JobStatus.RUNNING,
            JobStatus.WAITING_FOR_RESOURCES,
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.TIMED_OUT,
            JobStatus.CANCELLED,
            JobStatus.QUEUED,
        ]
    ):
        job_id = register(registry, run_id, index).job_id
        jobs[status] = job_id
        if status is JobStatus.QUEUED:
            continue
        if status is JobStatus.CANCELLED:
            registry.cancel_jobs([job_id])
            continue
        claimed = claim_one(registry)
        if status is JobStatus.WAITING_FOR_RESOURCES:
            wait = (claimed.job_id, claimed.lease_token, {"resources": {"GPU": 1.0}})
            registry.job_queue.wait_for_resources(OWNER, [wait])
        elif status is JobStatus.SUCCEEDED:
            ok = JobOutcome(succeeded=True, metrics={"accuracy": 0.5})
            registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, ok)
        elif status is JobStatus.FAILED:
            fail(registry, claimed)
        elif status is JobStatus.TIMED_OUT:
            fail(registry, claimed, error_type="TimeoutError", timed_out=True)
    assert {registry.get_job(i).status for i in jobs.values()} == {s.value for s in jobs}
    return jobs


def lease_rows(registry, ids):
    with registry.db.write() as conn:
        return conn.execute(select(*LEASE_COLUMNS).where(LEASE_COLUMNS[0].in_(ids))).all()


def statuses(registry, jobs):
    return {status: registry.get_job(job_id).status for status, job_id in jobs.items()}


def checkpoint_status(registry, job_id):
    job = registry.get_job(job_id)
    [checkpoint] = [c for c in registry.checkpoints(job.run) if c.id == job.checkpoint_id]
    return checkpoint.validation_status


# ------------------------------------------------ from which states each one applies
def test_claim_applies_to_queued_jobs_only(registry, one_job_per_state):
    before = statuses(registry, one_job_per_state)
    with registry.db.write() as conn:
        rows = transitions.claim(
            conn, list(one_job_per_state.values()), owner=OWNER, expires=NOW, now=NOW
        )
    assert [row.job_id for row in rows] == [one_job_per_state[JobStatus.QUEUED]]
    after = statuses(registry, one_job_per_state)
    assert after == {**before, JobStatus.QUEUED: "RUNNING"}
    assert transitions.FROM_STATES["claim"] == {JobStatus.QUEUED}


@pytest.mark.parametrize(
    "name, to",
    [("cancel", JobStatus.CANCELLED), ("retry", JobStatus.QUEUED)],
)
def test_cancel_and_retry_apply_to_their_from_states_only(registry, one_job_per_state, name, to):
    before = statuses(registry, one_job_per_state)
    rows = lease_rows(registry, list(one_job_per_state.values()))
    with registry.db.write() as conn:
        if name == "cancel":
            changed = transitions.cancel(conn, rows, error_type="Cancelled", message="x", now=NOW)
        else:
            changed = transitions.retry(conn, rows, NOW)
    allowed = transitions.FROM_STATES[name]
    assert sorted(changed) == sorted(one_job_per_state[s] for s in allowed)
    after = statuses(registry, one_job_per_state)
    for status, job_id in one_job_per_state.items():
        expected = to.value if status in allowed else before[status]
        assert after[status] == expected, status
        if status in allowed:
            mirrored = JOB_TO_VALIDATION_STATUS[to].value
            assert checkpoint_status(registry, job_id) == mirrored, status


def test_expire_and_finish_apply_to_leased_jobs_only(registry, one_job_per_state):
    before = statuses(registry, one_job_per_state)
    rows = lease_rows(registry, list(one_job_per_state.values()))
    with registry.db.write() as conn:
        # The token of a job that holds no lease fences nothing.
        finishable = [
            row.id for row in rows if transitions.running_job(conn, row.id, row.lease_token)
        ]
        expired = [
            row.id for row in rows if transitions.expire(conn, row, JobStatus.QUEUED, "gone", NOW)
        ]
    leased = [
        one_job_per_state[JobStatus.RUNNING],
        one_job_per_state[JobStatus.WAITING_FOR_RESOURCES],
    ]
    assert sorted(finishable) == sorted(expired) == sorted(leased)
    assert statuses(registry, one_job_per_state) == {
        **before,
        JobStatus.RUNNING: "QUEUED",
        JobStatus.WAITING_FOR_RESOURCES: "QUEUED",
    }
    waited = registry.get_job(one_job_per_state[JobStatus.WAITING_FOR_RESOURCES])
    assert (waited.waiting_since, waited.waiting_for) == (None, None)
    assert (
        transitions.FROM_STATES["expire"]
        == transitions.FROM_STATES["finish"]
        == transitions.FROM_STATES["extend_leases"]
        == {JobStatus.RUNNING, JobStatus.WAITING_FOR_RESOURCES}
    )


@pytest.mark.parametrize(
    "name, to",
    [
        ("wait_for_resources", JobStatus.WAITING_FOR_RESOURCES),
        ("start_running", JobStatus.RUNNING),
    ],
)
def test_waiting_for_resources_and_back_apply_to_their_from_states_only(
    registry, one_job_per_state, name, to
):
    before = statuses(registry, one_job_per_state)
    rows = lease_rows(registry, list(one_job_per_state.values()))
    with registry.db.write() as conn:
        if name == "wait_for_resources":
            waits = [(row.id, row.lease_token, {"resources": {"GPU": 2.0}}) for row in rows]
            changed = transitions.wait_for_resources(conn, OWNER, waits, NOW)
            # Only the lease holder moves its jobs.
            assert transitions.wait_for_resources(conn, "other/1", waits, NOW) == []
        else:
            leases = [(row.id, row.lease_token) for row in rows]
            changed = transitions.start_running(conn, OWNER, leases, NOW)
    [allowed] = transitions.FROM_STATES[name]
    assert changed == [one_job_per_state[allowed]]
    after = statuses(registry, one_job_per_state)
    assert after == {**before, allowed: to.value}
    assert checkpoint_status(registry, changed[0]) == JOB_TO_VALIDATION_STATUS[to].value
    job = registry.get_job(changed[0])
    if to is JobStatus.WAITING_FOR_RESOURCES:
        assert (job.waiting_since, job.waiting_for) == (NOW, {"resources": {"GPU": 2.0}})
    else:
        assert (job.waiting_since, job.waiting_for) == (None, None)
    # Waiting or not, the job keeps its lease, its attempt and its slot of the pool.
    assert job.lease_owner == OWNER and [a.status for a in job.attempt_history] == ["RUNNING"]
    assert registry.job_queue.running_per_pool() == {"CPU": 2}


# --------------------------------------------------------------- what each one writes
def test_enqueue_writes_a_due_queued_job_and_a_pending_checkpoint(registry, run_id):
    job_id = register(registry, run_id, 0, priority=3, max_attempts=2).job_id
    job = registry.get_job(job_id)
    assert (job.status, job.attempts, job.max_attempts, job.priority) == ("QUEUED", 0, 2, 3)
    assert job.lease_owner is None and job.lease_token == 0 and job.attempt_history == ()
    assert job.not_before <= dt.datetime.now(dt.timezone.utc)
    assert checkpoint_status(registry, job_id) == ValidationStatus.PENDING.value


def test_claim_writes_lease_token_attempt_and_running_checkpoint(registry, run_id):
    job_id = register(registry, run_id, 0).job_id
    claimed = claim_one(registry)
    job = registry.get_job(job_id)
    assert (job.status, job.attempts, job.lease_token, job.lease_owner) == (
        "RUNNING",
        1,
        1,
        OWNER,
    )
    assert job.lease_expires_at == claimed.lease_expires_at and job.started_at is not None
    [attempt] = job.attempt_history
    assert (attempt.attempt, attempt.lease_token, attempt.status) == (1, 1, "RUNNING")
    assert checkpoint_status(registry, job_id) == ValidationStatus.RUNNING.value
    assert (claimed.attempts_before_retry, claimed.retry_on_timeout) == (0, False)


def test_extend_leases_only_for_the_holder_of_the_token(registry, run_id):
    register(registry, run_id, 0)
    register(registry, run_id, 1)
    first, second = registry.job_queue.claim_due_jobs(OWNER, {}, lease_s=60)
    later = NOW + dt.timedelta(days=1)
    with registry.db.write() as conn:
        held = transitions.extend_leases(
            conn,
            OWNER,
            [(first.job_id, first.lease_token), (second.job_id, second.lease_token + 1)],
            later,
        )
        assert transitions.extend_leases(conn, "someone-else", [(first.job_id, 1)], later) == set()
    assert held == {first.job_id}
    assert registry.get_job(first.job_id).lease_expires_at == later
    assert registry.get_job(second.job_id).lease_expires_at == second.lease_expires_at


def test_finish_success_writes_metrics_and_closes_the_attempt(registry, run_id):
    job_id = register(registry, run_id, 0).job_id
    claimed = claim_one(registry)
    ok = JobOutcome(succeeded=True, metrics={"accuracy": 0.75}, node_id="n1", worker_pid=7)
    assert registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, ok)
    job = registry.get_job(job_id)
    assert (job.status, job.result_metrics, job.lease_owner) == (
        "SUCCEEDED",
        {"accuracy": 0.75},
        None,
    )
    assert job.finished_at is not None and job.lease_expires_at is None
    [attempt] = job.attempt_history
    assert (attempt.status, attempt.node_id, attempt.worker_pid) == ("SUCCEEDED", "n1", 7)
    [checkpoint] = registry.checkpoints("run-q")
    assert checkpoint.validation_status == ValidationStatus.VALIDATED.value
    assert checkpoint.metrics == {"loss": 0.0, "accuracy": 0.75}


def test_finish_records_the_policys_decision(registry, run_id):
    job_id = register(registry, run_id, 0, max_attempts=2).job_id
    retry_at = NOW + dt.timedelta(hours=1)

    class Fixed(RetryPolicy):
        def after_failure(self, **_kwargs):
            return Decision(JobStatus.QUEUED, retry_at)

    claimed = claim_one(registry)
    failure = JobOutcome(succeeded=False, error_type="OSError", error_message="flaky")
    assert registry.job_queue.finish_job(
        claimed.job_id, claimed.lease_token, failure, policy=Fixed()
    )
    job = registry.get_job(job_id)
    assert (job.status, job.not_before, job.error_type, job.finished_at) == (
        "QUEUED",
        retry_at,
        "OSError",
        None,
    )
    assert [a.status for a in job.attempt_history] == ["FAILED"]
    assert checkpoint_status(registry, job_id) == ValidationStatus.PENDING.value


def test_expire_requeues_at_once_then_fails_when_out_of_attempts(registry, run_id):
    job_id = register(registry, run_id, 0, max_attempts=2).job_id
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    claim_one(registry)
    assert registry.job_queue.requeue_expired(now=later) == [job_id]
    job = registry.get_job(job_id)
    assert (job.status, job.lease_owner, job.lease_expires_at) == ("QUEUED", None, None)
    assert job.not_before <= dt.datetime.now(dt.timezone.utc)
    assert job.attempt_history[0].status == "FAILED"
    assert "expired" in job.attempt_history[0].error_message
    claim_one(registry)
    assert registry.job_queue.requeue_expired(now=later) == []
    job = registry.get_job(job_id)
    assert (job.status, job.error_type) == ("FAILED", "LeaseExpired")
    assert checkpoint_status(registry, job_id) == ValidationStatus.FAILED.value


def test_cancel_closes_the_running_attempt(registry, run_id):
    job_id = register(registry, run_id, 0).job_id
    claim_one(registry)
    assert registry.cancel_jobs(run="run-q", reason="not needed") == [job_id]
    job = registry.get_job(job_id)
    assert (job.status, job.error_type, job.error_message) == (
        "CANCELLED",
        "Cancelled",
        "not needed",
    )
    assert job.lease_owner is None and job.finished_at is not None
    assert [(a.status, a.error_message) for a in job.attempt_history] == [
        ("CANCELLED", "not needed")
    ]
    assert checkpoint_status(registry, job_id) == ValidationStatus.CANCELLED.value


def test_retry_gives_a_fresh_budget_and_can_leave_cancelled_jobs(registry, run_id):
    failed = register(registry, run_id, 0, max_attempts=1).job_id
    fail(registry, claim_one(registry))
    cancelled = register(registry, run_id, 1).job_id
    registry.cancel_jobs([cancelled])
    only_failed = [JobStatus.FAILED, JobStatus.TIMED_OUT]
    assert registry.retry_jobs(run="run-q", statuses=only_failed) == [failed]
    assert registry.get_job(cancelled).status == "CANCELLED"
    job = registry.get_job(failed)
    assert (job.status, job.error_type, job.finished_at) == ("QUEUED", None, None)
    assert checkpoint_status(registry, failed) == ValidationStatus.PENDING.value
    claimed = claim_one(registry)  # a fresh budget: one more attempt although 1 was made
    assert (claimed.attempt, claimed.attempts_before_retry) == (2, 1)


def test_coalesce_cancels_older_queued_jobs_of_the_run(registry, run_id):
    old = register(registry, run_id, 0).job_id
    new = register(registry, run_id, 1, coalesce="latest").job_id
    assert registry.get_job(old).status == "CANCELLED"
    assert registry.get_job(old).error_type == "Coalesced"
    assert registry.get_job(new).status == "QUEUED"


# ----------------------------------------------------------------- the retry policy
def test_retry_policy_backs_off_while_attempts_last():
    policy = RetryPolicy(backoff_s=2.0, backoff_max_s=5.0, jitter=lambda: 1.0)
    budget = AttemptBudget(attempts=2, attempts_before_retry=0, max_attempts=3)
    decision = policy.after_failure(
        budget=budget, retryable=True, timed_out=False, retry_on_timeout=False, now=NOW
    )
    assert decision == Decision(JobStatus.QUEUED, NOW + dt.timedelta(seconds=4))
    spent = AttemptBudget(attempts=3, attempts_before_retry=0, max_attempts=3)
    assert policy.after_failure(
        budget=spent, retryable=True, timed_out=False, retry_on_timeout=False, now=NOW
    ) == Decision(JobStatus.FAILED)
    assert policy.after_failure(
        budget=budget, retryable=True, timed_out=True, retry_on_timeout=False, now=NOW
    ) == Decision(JobStatus.TIMED_OUT)
    assert policy.delay_s(10) == 5.0  # capped
    assert policy.after_lost_lease(budget=budget, now=NOW) == Decision(JobStatus.QUEUED, NOW)
    assert policy.after_lost_lease(budget=spent, now=NOW) == Decision(JobStatus.FAILED)
