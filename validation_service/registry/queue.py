"""The validation queue's statements: what is due, the jobs' records and counts, and the
jobs a change applies to. Each runs in its caller's transaction (it opens none).

Every change of a job's state goes through transitions.py; this module finds the jobs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.orm import Session, selectinload

from validation_service.errors import JobNotFound
from validation_service.jobs import (
    ACTIVE_JOB_STATUSES,
    DEFAULT_VALIDATOR,
    LEASED_JOB_STATUSES,
    JobStatus,
)
from validation_service.registry import raw_sql, transitions
from validation_service.registry.limits import IDS_PER_IN_LIST
from validation_service.registry.models import (
    Checkpoint,
    Run,
    ValidationAttempt,
    ValidationJob,
)
from validation_service.registry.records import (
    AttemptRecord,
    ClaimedJob,
    JobRecord,
    record_from,
)

_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATUSES)
_jobs = ValidationJob.__table__
# Jobs under a lease: RUNNING, or WAITING_FOR_RESOURCES (each takes a slot of its pool).
_LEASED = _jobs.c.status.in_(sorted(s.value for s in LEASED_JOB_STATUSES))

# What a transition needs to know of a job it applies to (see transitions.py).
LEASE_COLUMNS = (
    _jobs.c.id,
    _jobs.c.status,
    _jobs.c.lease_token,
    _jobs.c.lease_owner,
    _jobs.c.lease_expires_at,
    _jobs.c.checkpoint_id,
    _jobs.c.run_id,
    _jobs.c.attempts,
    _jobs.c.attempts_before_retry,
    _jobs.c.max_attempts,
    _jobs.c.validator,
)


# ------------------------------------------------------------------- reads
def validations(session: Session, run_id: int, run: str) -> list[JobRecord]:
    """The run attempt's jobs in id order, with their attempts."""
    rows = session.execute(
        select(ValidationJob, Checkpoint.report_index)
        .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
        .options(selectinload(ValidationJob.attempt_rows))
        .where(ValidationJob.run_id == run_id)
        .order_by(ValidationJob.id)
    ).all()
    return [job_record(job, run, index) for job, index in rows]


def list_jobs(
    session: Session,
    namespace: str,
    *,
    run_id: int | None = None,
    statuses: Sequence[str] | None = None,
    pool: str | None = None,
    limit: int | None = None,
) -> list[JobRecord]:
    """Jobs of the namespace (or of one run), filtered; the newest ``limit``, oldest first."""
    query = list_jobs_query(namespace, run_id, statuses or None, pool, limit)
    rows = session.execute(query).all()
    attempts = attempts_by_job(session, [job.id for job, _, _ in rows])
    return [
        job_record(job, run, index, attempts.get(job.id, ())) for job, index, run in reversed(rows)
    ]


def get_job(session: Session, job_id: int, namespace: str | None = None) -> JobRecord:
    """The job with this id (only if its run is in ``namespace``, when given)."""
    query = _job_query().where(ValidationJob.id == job_id)
    if namespace is not None:
        query = query.where(Run.namespace == namespace)
    row = session.execute(query).first()
    if row is None:
        raise JobNotFound(job_id)
    job, index, run = row
    return job_record(job, run, index)


def job_counts(session: Session, run_id: int | None) -> dict[str, int]:
    query = select(ValidationJob.status, func.count(ValidationJob.id)).group_by(
        ValidationJob.status
    )
    if run_id is not None:
        query = query.where(ValidationJob.run_id == run_id)
    return {status: count for status, count in session.execute(query)}


def job_counts_by_run(session: Session, namespace: str) -> dict[int, dict[str, int]]:
    """Run id -> {status: jobs}, for every run of the namespace, in one query."""
    counts: dict[int, dict[str, int]] = {}
    for run_id, status, count in session.execute(job_counts_by_run_query(namespace)):
        counts.setdefault(run_id, {})[status] = count
    return counts


def active_count(session: Session, run_id: int | None) -> int:
    """QUEUED and RUNNING jobs of the run (of every run: None)."""
    return session.scalar(active_count_query(run_id)) or 0


def find_job_id(session: Session | Connection, run_id: int, report_index: int) -> int | None:
    key = transitions.idempotency_key(run_id, report_index)
    return session.scalar(select(_jobs.c.id).where(_jobs.c.idempotency_key == key))


def due_pools(conn: Connection | Session, now: dt.datetime) -> list[str]:
    """Pools that have at least one QUEUED job whose not_before has passed."""
    params = {"queued": JobStatus.QUEUED.value, "now": now}
    return [pool for pool, due in conn.execute(raw_sql.DUE_POOLS, params) if due]


def running_per_pool(conn: Connection | Session) -> dict[str, int]:
    """RUNNING jobs per pool, whoever holds them."""
    return dict(conn.execute(_RUNNING_PER_POOL).all())


def running_in_pool(conn: Connection, pool: str) -> int:
    return conn.execute(_RUNNING_IN_POOL, {"b_pool": pool}).scalar_one()


# --------------------------------------------- jobs a transition applies to
def expired(conn: Connection, now: dt.datetime) -> Sequence[Row]:
    """Leased jobs whose lease ran out."""
    return conn.execute(select(*LEASE_COLUMNS).where(_LEASED, _jobs.c.lease_expires_at < now)).all()


def leased_by_others(conn: Connection, owner_prefix: str, keep_owner: str) -> Sequence[Row]:
    """Leased jobs of owners named ``owner_prefix...`` other than ``keep_owner``."""
    return conn.execute(
        select(*LEASE_COLUMNS).where(
            _LEASED,
            _jobs.c.lease_owner.startswith(owner_prefix, autoescape=True),
            _jobs.c.lease_owner != keep_owner,
        )
    ).all()


def leased_by(conn: Connection | Session, owner: str, exclude: set[int]) -> list[Row]:
    """Jobs leased by ``owner``, but those in ``exclude``."""
    rows = conn.execute(select(*LEASE_COLUMNS).where(_LEASED, _jobs.c.lease_owner == owner)).all()
    return [row for row in rows if row.id not in exclude]


def select_jobs(
    conn: Connection,
    statuses: Iterable[JobStatus],
    job_ids: Sequence[int] | None,
    run_id: int | None,
) -> Sequence[Row]:
    """Jobs in these statuses, by id and/or run, in id order."""
    query = select(*LEASE_COLUMNS).where(_jobs.c.status.in_([s.value for s in statuses]))
    if job_ids is not None:
        query = query.where(_jobs.c.id.in_(list(job_ids)))
    if run_id is not None:
        query = query.where(_jobs.c.run_id == run_id)
    return conn.execute(query.order_by(_jobs.c.id)).all()


def queued_before(conn: Connection, run_id: int, report_index: int) -> Sequence[Row]:
    """The run's QUEUED jobs of reports older than ``report_index`` (report()'s own:
    a named evaluation's jobs over history are no live run's to coalesce)."""
    checkpoints = Checkpoint.__table__
    return conn.execute(
        select(*LEASE_COLUMNS)
        .join(checkpoints, checkpoints.c.id == _jobs.c.checkpoint_id)
        .where(
            _jobs.c.run_id == run_id,
            _jobs.c.status == JobStatus.QUEUED.value,
            _jobs.c.validator == DEFAULT_VALIDATOR,
            checkpoints.c.report_index < report_index,
        )
        .order_by(_jobs.c.id)
    ).all()


def background_slots(limit: int, running: int) -> int:
    """How many of a pool's slots may hold jobs when background jobs (revalidations over
    history) are started: they leave one slot of a pool of two or more free for a live
    run's next validation."""
    return max(0, limit - running - (1 if limit > 1 else 0))


def lock_due_job_ids(
    conn: Connection, pool: str, now: dt.datetime, limit: int, background_limit: int
) -> list[int]:
    """The ids of up to ``limit`` due jobs of the pool, live runs' jobs first; background
    jobs only while fewer than ``background_limit`` jobs are taken."""
    # FOR UPDATE SKIP LOCKED lets several schedulers claim from one PostgreSQL queue
    # without blocking on each other's rows. SQLite ignores it: there the whole
    # transaction holds the write lock (BEGIN IMMEDIATE, see _engine.py).
    query = (
        select(_jobs.c.id, _jobs.c.background)
        .where(
            _jobs.c.status == JobStatus.QUEUED.value,
            _jobs.c.pool == pool,
            _jobs.c.not_before <= now,
        )
        .order_by(_jobs.c.background.asc(), _jobs.c.priority.desc(), _jobs.c.id.asc())
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    ids: list[int] = []
    for job_id, background in conn.execute(query):
        if background and len(ids) >= background_limit:
            break  # live jobs come first: only background ones are left
        ids.append(job_id)
    return ids


# A pool's slots: its RUNNING jobs and those WAITING_FOR_RESOURCES.
_RUNNING_PER_POOL = (
    select(_jobs.c.pool, func.count(_jobs.c.id)).where(_LEASED).group_by(_jobs.c.pool)
)
_RUNNING_IN_POOL = select(func.count(_jobs.c.id)).where(
    _LEASED, _jobs.c.pool == bindparam("b_pool")
)


def lock_pool(conn: Connection, pool: str) -> None:
    """On PostgreSQL, holds the pool's claim lock to the end of the transaction, so that
    replicas count the pool's running jobs one after another (a count read under another
    replica's uncommitted claim would let both fill the same free slots). Pools are
    visited in name order, so two replicas never wait on each other in a cycle. SQLite
    needs none: its write transaction holds the database."""
    if conn.dialect.name == "postgresql":
        conn.execute(raw_sql.POOL_LOCK, {"b_key": f"ckval-pool:{pool}"})


def claimed_job(row, expires: dt.datetime) -> ClaimedJob:
    """A claimed job (a transitions.claim row), as the executor gets it."""
    return record_from(
        ClaimedJob, row, job_id=row.job_id, attempt=row.attempts, lease_expires_at=expires
    )


def job_counts_by_run_query(namespace: str):
    """(run id, status, jobs) for every run of the namespace (the CLI's fast read runs it
    too)."""
    return (
        select(ValidationJob.run_id, ValidationJob.status, func.count(ValidationJob.id))
        .join(Run, Run.id == ValidationJob.run_id)
        .where(Run.namespace == namespace)
        .group_by(ValidationJob.run_id, ValidationJob.status)
    )


def active_count_query(run_id: int | None):
    """The count of QUEUED and RUNNING jobs of the run (of every run: None); the CLI's
    fast read runs it too."""
    query = select(func.count(_jobs.c.id)).where(_jobs.c.status.in_(_ACTIVE))
    if run_id is not None:
        query = query.where(_jobs.c.run_id == run_id)
    return query


def list_jobs_query(namespace: str, run_id: Any, statuses: Any, pool: Any, limit: Any):
    """The newest ``limit`` jobs (all: None) of the namespace, of one run, in ``statuses``
    and of ``pool`` where these are not None, with their report index and run name; their
    attempts are read by attempts_query. The CLI's fast read runs it too, compiled for
    each filter given or not."""
    query = _job_rows().where(Run.namespace == namespace)
    if run_id is not None:
        query = query.where(ValidationJob.run_id == run_id)
    if statuses is not None:
        query = query.where(ValidationJob.status.in_(statuses))
    if pool is not None:
        query = query.where(ValidationJob.pool == pool)
    return query.order_by(ValidationJob.id.desc()).limit(limit)


def attempts_query(job_ids: Any):
    """The attempts of these jobs, as AttemptRecord's columns after the job id, in attempt
    order (the CLI's fast read runs it too, compiled with an expanding ``job_ids``)."""
    return (
        select(_attempts.c.job_id, *_ATTEMPT_COLUMNS)
        .where(_attempts.c.job_id.in_(job_ids))
        .order_by(_attempts.c.attempt)
    )


def attempts_by_job(session: Session, job_ids: Sequence[int]) -> dict[int, tuple]:
    """Job id -> its AttemptRecords in attempt order (a query per IDS_PER_IN_LIST jobs)."""
    found: dict[int, list[AttemptRecord]] = {}
    for start in range(0, len(job_ids), IDS_PER_IN_LIST):
        chunk = job_ids[start : start + IDS_PER_IN_LIST]
        for row in session.execute(attempts_query(chunk)):
            found.setdefault(row.job_id, []).append(record_from(AttemptRecord, row))
    return {job_id: tuple(attempts) for job_id, attempts in found.items()}


def _job_rows():
    """Jobs with their report index and run name."""
    return (
        select(ValidationJob, Checkpoint.report_index, Run.name)
        .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
        .join(Run, Run.id == ValidationJob.run_id)
    )


def _job_query():
    """Jobs with their report index and run name, attempts loaded."""
    return _job_rows().options(selectinload(ValidationJob.attempt_rows))


def job_record(
    job: ValidationJob, run: str, report_index: int, attempts: tuple | None = None
) -> JobRecord:
    """A record of a job (with ``attempts``, else the job's loaded attempt rows)."""
    if attempts is None:
        attempts = tuple(record_from(AttemptRecord, a) for a in job.attempt_rows)
    return record_from(JobRecord, job, run=run, report_index=report_index, attempt_history=attempts)


_attempts = ValidationAttempt.__table__
# AttemptRecord's fields, all columns of validation_attempts.
_ATTEMPT_COLUMNS = tuple(_attempts.c[f.name] for f in dataclasses.fields(AttemptRecord))
