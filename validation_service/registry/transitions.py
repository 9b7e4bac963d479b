"""Named transitions of a validation job: the only code that writes a job's status, lease
and attempt rows, and the validation status its checkpoint mirrors.

    enqueue                                  -> QUEUED    (the row; registration.py
                                                              writes it with its checkpoint)
    claim          QUEUED                    -> RUNNING   (new lease token, attempt opened)
    wait_for_resources  RUNNING  -> WAITING_FOR_RESOURCES  (its Ray task waits; the holder)
    start_running  WAITING_FOR_RESOURCES     -> RUNNING   (its task began; the lease holder)
    extend_leases  RUNNING, WAITING_...      -> the same  (the lease holder only)
    finish         RUNNING, WAITING_...      -> SUCCEEDED | FAILED | TIMED_OUT | QUEUED
    expire         RUNNING, WAITING_...      -> QUEUED | FAILED  (its lease holder is gone)
    cancel         QUEUED, RUNNING, WAITING_... -> CANCELLED
    retry          FAILED, TIMED_OUT, CANCELLED -> QUEUED  (a fresh attempt budget, capped)

What an attempt held (node, accelerators, running time) is written with its end, or by
record_usage after the service stopped it on losing its lease.

Each takes an open connection (the caller owns the transaction) and repeats the states it
starts from in its WHERE clause, so it never applies to a job that moved on meanwhile.
Which state a finish or an expiry leads to is decided above the store (retry.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, case, func, insert, or_, select, update
from sqlalchemy.engine import Connection, Row

from validation_service.jobs import (
    ACTIVE_JOB_STATUSES,
    DEFAULT_VALIDATOR,
    JOB_TO_VALIDATION_STATUS,
    LEASED_JOB_STATUSES,
    JobStatus,
    ValidationStatus,
)
from validation_service.registry.models import Checkpoint, Run, ValidationAttempt, ValidationJob
from validation_service.registry.records import JobOutcome
from validation_service.registry.wakeups import wake_replicas
from validation_service.request import ValidationRequest
from validation_service.retry import counted_from_after_retry
from validation_service.validation import capped_text

_jobs, _checkpoints, _attempts = (
    ValidationJob.__table__,
    Checkpoint.__table__,
    ValidationAttempt.__table__,
)

FROM_STATES: dict[str, frozenset[JobStatus]] = {
    "claim": frozenset({JobStatus.QUEUED}),
    "wait_for_resources": frozenset({JobStatus.RUNNING}),
    "start_running": frozenset({JobStatus.WAITING_FOR_RESOURCES}),
    "extend_leases": LEASED_JOB_STATUSES,
    "finish": LEASED_JOB_STATUSES,
    "expire": LEASED_JOB_STATUSES,
    "cancel": ACTIVE_JOB_STATUSES,
    "retry": frozenset({JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED}),
}


# What every transition out of a leased state clears, and what a requeue by the user clears.
_NO_LEASE = {
    "lease_owner": None,
    "lease_expires_at": None,
    "waiting_since": None,
    "waiting_for": None,
}
_NO_ERROR = {"error_type": None, "error_message": None, "error_traceback": None}


def _in_from_states(transition: str):
    """The WHERE clause "the job is in a state this transition starts from"."""
    states = sorted(status.value for status in FROM_STATES[transition])
    # One state: an equality, which compiles once (an IN list is expanded per execution).
    return _jobs.c.status == states[0] if len(states) == 1 else _jobs.c.status.in_(states)


# ------------------------------------------------------------------ enqueue
def idempotency_key(run_id: int, report_index: int) -> str:
    return f"run:{run_id}/report:{report_index}"


def enqueue_row(
    request: ValidationRequest,
    checkpoint_id: int,
    run_id: int,
    report_index: int,
    now: dt.datetime,
) -> dict[str, Any]:
    """The validation_jobs row of a new job: QUEUED and due at once."""
    return {
        "checkpoint_id": checkpoint_id,
        "run_id": run_id,
        "idempotency_key": idempotency_key(run_id, report_index),
        "validate_fn_ref": request.validate_fn_ref,
        "validate_fn_pickle": request.validate_fn_pickle,
        "validate_fn_name": request.validate_fn_name[:512],
        "validate_config": request.validate_config,
        "executor_kind": request.executor_kind,
        "resources": request.resources,
        "pool": request.pool,
        "priority": request.priority,
        "validator": request.validator,
        "background": request.background,
        "status": JobStatus.QUEUED.value,
        "attempts": 0,
        "max_attempts": request.max_attempts,
        "attempts_before_retry": 0,
        "lease_token": 0,
        "timeout_s": request.timeout_s,
        "retry_on_timeout": request.retry_on_timeout,
        "not_before": now,
        "created_at": now,
        "updated_at": now,
    }


def registered_status(request: ValidationRequest | None) -> str:
    """The validation status a new checkpoint is written with: the mirror of its job's
    QUEUED (PENDING), or NONE when it has no job."""
    if request is None:
        return ValidationStatus.NONE.value
    return JOB_TO_VALIDATION_STATUS[JobStatus.QUEUED].value


# -------------------------------------------------------------------- claim
def claim(
    conn: Connection, ids: Sequence[int], *, owner: str, expires: dt.datetime, now: dt.datetime
) -> list[Row]:
    """QUEUED -> RUNNING under a new lease token; opens an attempt row for each job.

    ``ids`` were locked by the caller; one that is no longer QUEUED is left alone.
    Returns the claimed jobs' _CLAIMED_JOBS rows, by priority.
    """
    params = {"b_ids": list(ids), "b_owner": owner, "b_expires": expires, "b_now": now}
    # Only the ids still QUEUED are claimed; RETURNING says which.
    claimed = list(conn.execute(_CLAIM_JOBS, params).scalars())
    if not claimed:
        return []
    conn.execute(_SET_CLAIMED_CHECKPOINTS_RUNNING, {"b_ids": claimed})
    rows = conn.execute(_CLAIMED_JOBS, {"b_ids": claimed}).all()
    if rows:
        conn.execute(
            _INSERT_ATTEMPT,
            [
                {
                    "job_id": row.job_id,
                    "attempt": row.attempts,
                    "lease_token": row.lease_token,
                    "lease_owner": owner,
                    "status": JobStatus.RUNNING.value,
                    "claimed_at": now,
                }
                for row in rows
            ],
        )
    return rows


def extend_leases(
    conn: Connection, owner: str, leases: Iterable[tuple[int, int]], expires: dt.datetime
) -> set[int]:
    """Moves the expiry of the leases ``owner`` still holds; returns those jobs' ids."""
    held = and_(
        _in_from_states("extend_leases"),
        _jobs.c.lease_owner == owner,
        or_(
            *(and_(_jobs.c.id == job_id, _jobs.c.lease_token == token) for job_id, token in leases)
        ),
    )
    conn.execute(update(_jobs).where(held).values(lease_expires_at=expires))
    return set(conn.execute(select(_jobs.c.id).where(held)).scalars())


# ------------------------------------------------- waiting for resources
def wait_for_resources(
    conn: Connection,
    owner: str,
    waits: Sequence[tuple[int, int, dict[str, Any]]],
    now: dt.datetime,
) -> list[int]:
    """RUNNING -> WAITING_FOR_RESOURCES for the (job id, lease token, what it waits for)
    leases ``owner`` holds: their Ray task waits for resources. Returns the ids moved."""
    moved = [
        row
        for job_id, token, waiting_for in waits
        for row in _held_move(
            conn,
            (owner, job_id, token),
            "wait_for_resources",
            status=JobStatus.WAITING_FOR_RESOURCES.value,
            waiting_since=now,
            waiting_for=waiting_for,
            updated_at=now,
        )
    ]
    _mirror(conn, moved, JobStatus.WAITING_FOR_RESOURCES)
    return [row.id for row in moved]


def start_running(
    conn: Connection, owner: str, leases: Sequence[tuple[int, int]], now: dt.datetime
) -> list[int]:
    """WAITING_FOR_RESOURCES -> RUNNING for the (job id, lease token) leases ``owner``
    holds: their Ray task began to run. Returns the ids moved."""
    moved = [
        row
        for job_id, token in leases
        for row in _held_move(
            conn,
            (owner, job_id, token),
            "start_running",
            status=JobStatus.RUNNING.value,
            waiting_since=None,
            waiting_for=None,
            updated_at=now,
        )
    ]
    _mirror(conn, moved, JobStatus.RUNNING)
    return [row.id for row in moved]


def _held_move(conn: Connection, lease: tuple[str, int, int], transition: str, **values):
    """Sets ``values`` on the job of this (owner, job id, lease token) while it is in the
    transition's from-states; the job's (id, checkpoint_id, validator) if it moved."""
    owner, job_id, token = lease
    return conn.execute(
        update(_jobs)
        .where(
            _jobs.c.id == job_id,
            _jobs.c.lease_token == token,
            _jobs.c.lease_owner == owner,
            _in_from_states(transition),
        )
        .values(values)
        .returning(_jobs.c.id, _jobs.c.checkpoint_id, _jobs.c.validator)
    ).all()


def record_usage(
    conn: Connection, job_id: int, lease_token: int, outcome: JobOutcome, now: dt.datetime
) -> bool:
    """What an attempt held, written after its end: the service stopped its task when it
    lost the lease (a cancel, a takeover), so the attempt row was closed without it.
    Only an attempt whose running time is still unknown is written."""
    values = _usage(outcome, now)
    if values["running_s"] is None:
        return False
    changed = conn.execute(
        _UPDATE_ATTEMPT.where(_attempts.c.running_s.is_(None)),
        {"b_job_id": job_id, "b_lease_token": lease_token, **values, "finished_at": now},
    ).rowcount
    if changed:  # /metrics reads the attempts of jobs changed since its last scrape
        conn.execute(_UPDATE_JOB, {"b_job_id": job_id, "updated_at": now})
    return bool(changed)


def _usage(outcome: JobOutcome, now: dt.datetime) -> dict[str, Any]:
    """The attempt row's columns of what it held, from an outcome."""
    running_s = None
    if outcome.started_at is not None:
        ended = outcome.finished_at or now
        running_s = max(0.0, (ended - outcome.started_at).total_seconds())
    return {
        "node_id": outcome.node_id,
        "started_at": outcome.started_at,
        "accelerator_type": outcome.accelerator_type,
        "accelerators": outcome.accelerators,
        "running_s": running_s,
    }


# ------------------------------------------------------------------- finish
def running_job(conn: Connection, job_id: int, lease_token: int) -> Row | None:
    """The RUNNING job this lease token still fences (with what finishing it needs)."""
    return conn.execute(
        _RUNNING_JOB_TO_FINISH, {"b_job_id": job_id, "b_lease_token": lease_token}
    ).one_or_none()


def succeeded_job(conn: Connection, job_id: int, lease_token: int) -> Row | None:
    """The job's (run_id, validator) when the attempt of this lease token is recorded
    SUCCEEDED: only that token's own finish writes it, so a retried finish that finds it
    had committed."""
    return conn.execute(
        select(_jobs.c.run_id, _jobs.c.validator)
        .join(_attempts, _attempts.c.job_id == _jobs.c.id)
        .where(
            _jobs.c.id == job_id,
            _attempts.c.lease_token == lease_token,
            _attempts.c.status == JobStatus.SUCCEEDED.value,
        )
    ).one_or_none()


def finish(
    conn: Connection,
    job: Row,
    outcome: JobOutcome,
    status: JobStatus,
    now: dt.datetime,
    *,
    not_before: dt.datetime | None = None,
    result_metrics: dict[str, Any] | None = None,
    checkpoint_columns: dict[str, Any] | None = None,
) -> None:
    """RUNNING -> ``status`` for the attempt ``job`` (a running_job row) that just ended.

    SUCCEEDED stores ``result_metrics``; a failure stores the outcome's error, and QUEUED
    makes the job due again at ``not_before``. The checkpoint gets the mirrored status
    and ``checkpoint_columns`` (its merged metrics) in the same statement.
    """
    if status is JobStatus.SUCCEEDED:
        values: dict[str, Any] = {"result_metrics": result_metrics, **_NO_ERROR}
    else:
        # Capped however the executor made them: an attempt's output is not the
        # registry's to hold whole (a program can write gigabytes to its stderr).
        values = {
            "error_type": outcome.error_type,
            "error_message": capped_text(outcome.error_message),
            "error_traceback": capped_text(outcome.error_traceback),
        }
        if status is JobStatus.QUEUED:
            values["not_before"] = not_before or now
    values.update(_NO_LEASE, b_job_id=job.id, status=status.value, updated_at=now)
    values["finished_at"] = now if status.is_terminal else None
    conn.execute(_UPDATE_JOB, values)
    if job.validator == DEFAULT_VALIDATOR:  # a named evaluation leaves the checkpoint be
        checkpoint_values = {**(checkpoint_columns or {}), "b_checkpoint_id": job.checkpoint_id}
        checkpoint_values["validation_status"] = JOB_TO_VALIDATION_STATUS[status].value
        conn.execute(_UPDATE_CHECKPOINT, checkpoint_values)
    conn.execute(
        _UPDATE_ATTEMPT,
        {
            "b_job_id": job.id,
            "b_lease_token": job.lease_token,
            # A retried attempt failed; the job's own status says it runs again.
            "status": (status if status.is_terminal else JobStatus.FAILED).value,
            **_usage(outcome, now),
            "worker_pid": outcome.worker_pid,
            "finished_at": outcome.finished_at or now,
            "error_message": None if outcome.succeeded else capped_text(outcome.error_message),
            "log": capped_text(outcome.log),
        },
    )


# ------------------------------------------------------------------- expire
def expire(
    conn: Connection,
    job: Row,
    status: JobStatus,
    message: str,
    now: dt.datetime,
    *,
    not_before: dt.datetime | None = None,
) -> bool:
    """RUNNING -> QUEUED (due at ``not_before``) or FAILED: the lease holder of ``job`` is gone.

    ``job`` is a queue.LEASE_COLUMNS row; False when it moved on meanwhile.
    """
    values: dict[str, Any] = {"status": status.value, **_NO_LEASE, "updated_at": now}
    if status is JobStatus.QUEUED:
        values["not_before"] = not_before or now
    else:
        values.update(finished_at=now, error_type="LeaseExpired", error_message=message)
    changed = conn.execute(
        update(_jobs)
        .where(
            _jobs.c.id == job.id,
            _jobs.c.lease_token == job.lease_token,
            _in_from_states("expire"),
        )
        .values(values)
    ).rowcount
    if not changed:
        return False
    _close_attempts(conn, [job], JobStatus.FAILED, message, now)
    _mirror(conn, [job], status)
    return True


# ------------------------------------------------------------- cancel, retry
def cancel(
    conn: Connection,
    jobs: Sequence[Row],
    *,
    error_type: str,
    message: str,
    now: dt.datetime,
) -> list[int]:
    """QUEUED or RUNNING -> CANCELLED; a RUNNING job loses its lease at once.

    ``jobs`` are queue.LEASE_COLUMNS rows; returns the ids cancelled.
    """
    values = {
        "status": JobStatus.CANCELLED.value,
        **_NO_LEASE,
        "error_type": error_type,
        "error_message": message,
        "error_traceback": None,
        "finished_at": now,
        "updated_at": now,
    }
    cancelled = _move(conn, jobs, "cancel", values)
    leased = {status.value for status in LEASED_JOB_STATUSES}
    running = [job for job in cancelled if job.status in leased]
    _close_attempts(conn, running, JobStatus.CANCELLED, message, now)
    _mirror(conn, cancelled, JobStatus.CANCELLED)
    if running:
        wake_replicas(conn)
    return [job.id for job in cancelled]


def retry(
    conn: Connection, jobs: Sequence[Row], now: dt.datetime, *, max_retries: int | None = None
) -> list[int]:
    """FAILED, TIMED_OUT or CANCELLED -> QUEUED with a fresh budget of attempts.

    With ``max_retries`` the budget stops at max_attempts x (1 + max_retries) attempts in
    all (the caller leaves out jobs that made them already; see retry.py).
    """
    budget_from = counted_from_after_retry(
        _jobs.c.attempts, _jobs.c.max_attempts, max_retries, least=_least
    )
    values = {
        "status": JobStatus.QUEUED.value,
        "attempts_before_retry": budget_from,
        **_NO_ERROR,
        "not_before": now,
        "finished_at": None,
        "updated_at": now,
    }
    requeued = _move(conn, jobs, "retry", values)
    _mirror(conn, requeued, JobStatus.QUEUED)
    if requeued:
        wake_replicas(conn)
    return [job.id for job in requeued]


def _move(
    conn: Connection, jobs: Sequence[Row], transition: str, values: dict[str, Any]
) -> list[Row]:
    """Sets ``values`` on those of ``jobs`` still in the transition's from-states; returns
    those jobs."""
    if not jobs:
        return []
    changed = conn.execute(
        update(_jobs)
        .where(_jobs.c.id.in_([job.id for job in jobs]), _in_from_states(transition))
        .values(values)
        .returning(_jobs.c.id)
    )
    changed_ids = set(changed.scalars())
    return [job for job in jobs if job.id in changed_ids]


def _least(a: Any, b: Any) -> Any:
    """The smaller of two SQL expressions (SQLite's min() and PostgreSQL's LEAST differ)."""
    return case((a < b, a), else_=b)


def _close_attempts(
    conn: Connection, jobs: Sequence[Row], status: JobStatus, message: str, now: dt.datetime
) -> None:
    if jobs:
        conn.execute(
            _UPDATE_ATTEMPT,
            [
                {
                    "b_job_id": job.id,
                    "b_lease_token": job.lease_token,
                    "status": status.value,
                    "finished_at": now,
                    "error_message": message,
                }
                for job in jobs
            ],
        )


def _mirror(conn: Connection, jobs: Sequence[Row], status: JobStatus) -> None:
    """The checkpoint's validation_status follows its report()'s job's status (the jobs
    of named evaluations over history leave it as it is)."""
    checkpoint_ids = [job.checkpoint_id for job in jobs if job.validator == DEFAULT_VALIDATOR]
    if not checkpoint_ids:
        return
    conn.execute(
        update(_checkpoints)
        .where(_checkpoints.c.id.in_(checkpoint_ids))
        .values(validation_status=JOB_TO_VALIDATION_STATUS[status].value)
    )


# Statements built once, values bound per call (parameters prefixed "b_" bind the WHERE
# clauses; the others are the columns set): SQLAlchemy then reuses the compiled form.
_RUNNING_JOB_TO_FINISH = (
    select(
        _jobs.c.id,
        _jobs.c.lease_token,
        _jobs.c.checkpoint_id,
        _jobs.c.run_id,
        _jobs.c.attempts,
        _jobs.c.attempts_before_retry,
        _jobs.c.max_attempts,
        _jobs.c.retry_on_timeout,
        _jobs.c.validator,
        _checkpoints.c.reported_metrics,
        _checkpoints.c.deleted_at,
    )
    .join(_checkpoints, _checkpoints.c.id == _jobs.c.checkpoint_id)
    .where(
        _jobs.c.id == bindparam("b_job_id"),
        _jobs.c.lease_token == bindparam("b_lease_token"),
        _in_from_states("finish"),
    )
    # PostgreSQL: the row stays locked until the outcome is written, so a replica that
    # expires or claims the job meanwhile waits, then sees it finished (the fence holds
    # between the check and the write). SQLite's write transaction holds the database.
    .with_for_update(of=_jobs)
)
_UPDATE_JOB = update(_jobs).where(_jobs.c.id == bindparam("b_job_id"))
_UPDATE_CHECKPOINT = update(_checkpoints).where(_checkpoints.c.id == bindparam("b_checkpoint_id"))
_ATTEMPT_OF_LEASE = and_(
    _attempts.c.job_id == bindparam("b_job_id"),
    _attempts.c.lease_token == bindparam("b_lease_token"),
)
_UPDATE_ATTEMPT = update(_attempts).where(_ATTEMPT_OF_LEASE)
_CLAIMED_IDS = _jobs.c.id.in_(bindparam("b_ids", expanding=True))
_CLAIM_JOBS = (
    update(_jobs)
    .where(_CLAIMED_IDS, _in_from_states("claim"))
    .values(
        status=JobStatus.RUNNING.value,
        attempts=_jobs.c.attempts + 1,
        lease_token=_jobs.c.lease_token + 1,
        lease_owner=bindparam("b_owner"),
        lease_expires_at=bindparam("b_expires", type_=_jobs.c.lease_expires_at.type),
        updated_at=bindparam("b_now", type_=_jobs.c.updated_at.type),
        started_at=func.coalesce(
            _jobs.c.started_at, bindparam("b_now", type_=_jobs.c.started_at.type)
        ),
    )
    .returning(_jobs.c.id)
)
_SET_CLAIMED_CHECKPOINTS_RUNNING = (
    update(_checkpoints)
    .where(
        _checkpoints.c.id.in_(
            select(_jobs.c.checkpoint_id).where(
                _CLAIMED_IDS, _jobs.c.validator == DEFAULT_VALIDATOR
            )
        )
    )
    .values(validation_status=ValidationStatus.RUNNING.value)
)
_runs = Run.__table__
_CLAIMED_JOBS = (
    select(
        _jobs.c.id.label("job_id"),
        _jobs.c.lease_token,
        _jobs.c.attempts,
        _jobs.c.attempts_before_retry,
        _jobs.c.max_attempts,
        _jobs.c.retry_on_timeout,
        _jobs.c.validate_fn_ref,
        _jobs.c.validate_fn_pickle,
        _jobs.c.validate_config,
        _jobs.c.executor_kind,
        _jobs.c.resources,
        _jobs.c.pool,
        _jobs.c.timeout_s,
        _jobs.c.validator,
        _jobs.c.idempotency_key,
        _checkpoints.c.id.label("checkpoint_id"),
        _checkpoints.c.report_index,
        _checkpoints.c.uri,
        _checkpoints.c.manifest_sha256,
        _checkpoints.c.reported_metrics,
        _runs.c.name.label("run"),
        _runs.c.namespace,
        _runs.c.storage_root,
    )
    .join(_checkpoints, _checkpoints.c.id == _jobs.c.checkpoint_id)
    .join(_runs, _runs.c.id == _checkpoints.c.run_id)
    .where(_CLAIMED_IDS)
    .order_by(_jobs.c.background.asc(), _jobs.c.priority.desc(), _jobs.c.id.asc())
)
_INSERT_ATTEMPT = insert(_attempts)
