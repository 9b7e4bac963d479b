"""Aggregate reads for the dashboard and /metrics: grouped counts, series, durations.

Every function here is one or a few grouped statements over a read session: per-run and
per-pool figures come from GROUP BY, never from a query per row, so a page of runs or a
scrape costs the same at 10 runs as at 1,000.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import Float, and_, bindparam, case, cast, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from validation_service.jobs import ACTIVE_JOB_STATUSES, LEASED_JOB_STATUSES, JobStatus
from validation_service.metrics import lower_is_better
from validation_service.registry import costs
from validation_service.registry.models import (
    Checkpoint,
    MetricValue,
    Run,
    ValidationAttempt,
    ValidationJob,
)
from validation_service.registry.records import AttemptRecord, JobRecord, RunRecord, record_from
from validation_service.validation import INT64_MAX, MAX_BEST_K, check_int

Mode = Literal["max", "min"]

_QUEUED = JobStatus.QUEUED.value
_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATUSES)
_LEASED = sorted(s.value for s in LEASED_JOB_STATUSES)
_TERMINAL = sorted(
    s.value
    for s in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED)
)


@dataclasses.dataclass(frozen=True)
class RunActivity:
    """One run of a runs page: its counts, its best value of the chosen metric, and when
    anything last happened to it (a report, or a change of one of its jobs)."""

    run: RunRecord
    checkpoints: int
    job_counts: dict[str, int]
    best: float | None
    last_activity: dt.datetime


@dataclasses.dataclass(frozen=True)
class RunPage:
    runs: list[RunActivity]
    page: int
    per_page: int
    total: int  # runs in the namespace
    metrics: list[str]  # metric names recorded by the runs of this page
    active_jobs: int  # QUEUED or RUNNING jobs of the runs of this page
    metric: str | None  # the metric ``best`` is of
    mode: Mode


@dataclasses.dataclass(frozen=True)
class MetricPoint:
    run: str
    report_index: int
    value: float


@dataclasses.dataclass(frozen=True)
class QueueHealth:
    """What the queue says about whether a scheduler serves it (see queue_health)."""

    live_leases: int  # leased jobs whose lease a scheduler extended recently enough
    expired_leases: int  # leased jobs whose lease ran out and nobody requeued
    overdue_queued: int  # QUEUED jobs due for longer than the grace period, unclaimed
    oldest_due_s: float  # age of the oldest due QUEUED job (0 when none)


def default_mode(metric: str) -> Mode:
    """ "min" for metrics named like a loss or an error rate, else "max"."""
    return "min" if lower_is_better(metric) else "max"


# ------------------------------------------------------------------ dashboard
def _newest_runs(
    session: Session, namespace: str, page: int, per_page: int, total: int
) -> list[tuple[int, dt.datetime]]:
    """(run id, last activity) of the runs of one page, newest activity first; none past
    the last page."""
    offset = (page - 1) * per_page
    if offset >= total:
        return []
    last_activity = _last_activity(session.get_bind().dialect.name)
    newest_first = (
        select(Run.id, last_activity)
        .where(Run.namespace == namespace)
        .order_by(last_activity.desc(), Run.id.desc())
        .limit(per_page)
        .offset(offset)
    )
    return [(run_id, _aware(at)) for run_id, at in session.execute(newest_first)]


def run_page(
    session: Session,
    namespace: str,
    *,
    page: int,
    per_page: int,
    metric: str | None,
    mode: Mode | None,
) -> RunPage:
    """One page of the namespace's runs, newest activity first, with grouped counts.

    ``metric`` None ranks by the first metric the page's runs recorded; ``mode`` None takes
    the usual direction of the metric's name (see default_mode). A page past the last one
    is empty; one whose offset no 64-bit integer holds is refused (InvalidInput).
    """
    check_int(per_page, "per_page", 1, MAX_BEST_K)
    check_int(page, "page", 1, INT64_MAX // per_page)
    total = session.scalar(select(func.count()).where(Run.namespace == namespace)) or 0
    chosen = _newest_runs(session, namespace, page, per_page, total)
    ids = [run_id for run_id, _ in chosen]
    if not ids:
        return RunPage([], page, per_page, total, [], 0, metric, mode or "max")
    runs = {
        run.id: record_from(RunRecord, run)
        for run in session.scalars(select(Run).where(Run.id.in_(ids)))
    }
    checkpoints = dict(
        session.execute(
            select(Checkpoint.run_id, func.count(Checkpoint.id))
            .where(Checkpoint.run_id.in_(ids), Checkpoint.deleted_at.is_(None))
            .group_by(Checkpoint.run_id)
        ).all()
    )
    counts: dict[int, dict[str, int]] = {}
    for run_id, status, count in session.execute(
        select(ValidationJob.run_id, ValidationJob.status, func.count(ValidationJob.id))
        .where(ValidationJob.run_id.in_(ids))
        .group_by(ValidationJob.run_id, ValidationJob.status)
    ):
        counts.setdefault(run_id, {})[status] = count
    names = run_metric_names(session, ids)
    if metric is None and names:
        metric = names[0]
    mode = mode or default_mode(metric or "")
    best = _best_per_run(session, ids, metric, mode) if metric else {}
    active = sum(c.get(status, 0) for c in counts.values() for status in _ACTIVE)
    rows = [
        RunActivity(
            runs[run_id], checkpoints.get(run_id, 0), counts.get(run_id, {}), best.get(run_id), last
        )
        for run_id, last in chosen
    ]
    return RunPage(rows, page, per_page, total, names, active, metric, mode)


def _last_activity(dialect: str) -> ColumnElement[dt.datetime]:
    """A run's last activity: the latest of its creation, its newest report and its last
    job change.

    Two index seeks per run (the checkpoints' unique (run_id, report_index) and the jobs'
    (run_id, updated_at)); the database sorts and pages, so only a page of rows comes back.
    """
    newest_report = (
        select(Checkpoint.created_at)
        .where(Checkpoint.run_id == Run.id)
        .order_by(Checkpoint.report_index.desc())
        .limit(1)
        .scalar_subquery()
    )
    last_job_change = (
        select(func.max(ValidationJob.updated_at))
        .where(ValidationJob.run_id == Run.id)
        .scalar_subquery()
    )
    if dialect == "postgresql":  # GREATEST skips NULLs
        return func.greatest(
            Run.created_at, newest_report, last_job_change, type_=Run.created_at.type
        )
    # SQLite's max() of several arguments is NULL if one is: a run without reports or jobs
    # falls back on its creation. Its timestamps are ISO text, which sorts as time does.
    return func.max(
        Run.created_at,
        func.coalesce(newest_report, Run.created_at),
        func.coalesce(last_job_change, Run.created_at),
        type_=Run.created_at.type,
    )


def _aware(value: dt.datetime | str) -> dt.datetime:
    if isinstance(value, str):  # SQLite returns max() of a DATETIME column as text
        value = dt.datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def _best_per_run(
    session: Session, run_ids: Sequence[int], metric: str, mode: Mode
) -> dict[int, float]:
    best = func.max(MetricValue.value) if mode == "max" else func.min(MetricValue.value)
    return dict(
        session.execute(
            select(MetricValue.run_id, best)
            .where(
                MetricValue.run_id.in_(run_ids),
                MetricValue.name == metric,
                MetricValue.effective == True,  # noqa: E712 - equality lets the index serve
            )
            .group_by(MetricValue.run_id)
        ).all()
    )


def run_record(session: Session, namespace: str, name: str) -> RunRecord | None:
    """The record of the named run's latest attempt, or None."""
    run = session.scalar(
        select(Run)
        .where(Run.namespace == namespace, Run.name == name)
        .order_by(Run.attempt.desc())
        .limit(1)
    )
    return None if run is None else record_from(RunRecord, run)


def metric_series(
    session: Session, run_ids: dict[int, str], metric: str
) -> dict[str, list[MetricPoint]]:
    """Run name -> the effective values of one metric by report index, in one query."""
    rows = session.execute(
        select(MetricValue.run_id, Checkpoint.report_index, MetricValue.value)
        .join(Checkpoint, Checkpoint.id == MetricValue.checkpoint_id)
        .where(
            MetricValue.run_id.in_(list(run_ids)),
            MetricValue.name == metric,
            MetricValue.effective == True,  # noqa: E712
        )
        .order_by(MetricValue.run_id, Checkpoint.report_index)
    )
    series: dict[str, list[MetricPoint]] = {name: [] for name in run_ids.values()}
    for run_id, index, value in rows:
        series[run_ids[run_id]].append(MetricPoint(run_ids[run_id], index, value))
    return series


def run_metric_names(session: Session, run_ids: Sequence[int]) -> list[str]:
    return sorted(
        session.scalars(
            select(MetricValue.name).where(MetricValue.run_id.in_(list(run_ids))).distinct()
        ).all()
    )


def active_jobs(session: Session, run_ids: Sequence[int]) -> int:
    return (
        session.scalar(
            select(func.count(ValidationJob.id)).where(
                ValidationJob.run_id.in_(list(run_ids)),
                ValidationJob.status.in_(_ACTIVE),
            )
        )
        or 0
    )


def run_jobs(session: Session, run_id: int, run: str) -> list[JobRecord]:
    """The run's jobs with their attempts, in two queries of plain columns (a job's stored
    validate_fn and config, which can be large, are never read)."""
    attempts: dict[int, list[AttemptRecord]] = {}
    for row in session.execute(
        select(ValidationAttempt.job_id, *_ATTEMPT_COLUMNS)
        .join(ValidationJob, ValidationJob.id == ValidationAttempt.job_id)
        .where(ValidationJob.run_id == run_id)
        .order_by(ValidationAttempt.job_id, ValidationAttempt.attempt)
    ):
        attempts.setdefault(row.job_id, []).append(record_from(AttemptRecord, row))
    rows = session.execute(
        select(*_JOB_COLUMNS, Checkpoint.report_index)
        .join(Checkpoint, Checkpoint.id == ValidationJob.checkpoint_id)
        .where(ValidationJob.run_id == run_id)
        .order_by(ValidationJob.id)
    )
    return [
        record_from(JobRecord, row, run=run, attempt_history=tuple(attempts.get(row.id, ())))
        for row in rows
    ]


_JOB_COLUMNS = tuple(
    ValidationJob.__table__.c[f.name]
    for f in dataclasses.fields(JobRecord)
    if f.name not in ("run", "report_index", "attempt_history")
)
_ATTEMPT_COLUMNS = tuple(
    ValidationAttempt.__table__.c[f.name] for f in dataclasses.fields(AttemptRecord)
)


# -------------------------------------------------------------- /metrics
def jobs_by_status_and_pool(session: Session) -> list[tuple[str, str, int]]:
    """(status, pool, jobs) for every pair that has jobs, in one grouped query."""
    query = select(ValidationJob.status, ValidationJob.pool, func.count()).group_by(
        ValidationJob.status, ValidationJob.pool
    )
    return [(status, pool, count) for status, pool, count in session.execute(query)]


def runs_by_status(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).all())


def checkpoints_registered(session: Session) -> int:
    """Every checkpoint row ever registered (deleted ones too: a counter never goes down)."""
    return session.scalar(select(func.count()).select_from(Checkpoint)) or 0


Buckets = dict[str, dict[int, tuple[int, float]]]  # pool -> bucket index -> (jobs, seconds)


def job_time_totals(
    session: Session,
    duration_bounds: Sequence[float],
    latency_bounds: Sequence[float],
    until: dt.datetime,
) -> tuple[Buckets, Buckets]:
    """Validation duration (first claim -> finish, of jobs that ended) and dispatch latency
    (enqueue -> first claim) of every job whose finish, resp. first claim, is at or before
    ``until``, bucketed in SQL: one grouped query each, a row per (pool, bucket) back.

    Bucket i counts the jobs of at most bounds[i] seconds and more than bounds[i - 1];
    bucket len(bounds) is the rest (+Inf).
    """
    dialect = session.get_bind().dialect.name
    params = {"b_until": until}
    durations = session.execute(
        _histogram_query(dialect, "duration", tuple(duration_bounds)), params
    )
    latencies = session.execute(_histogram_query(dialect, "latency", tuple(latency_bounds)), params)
    return _bucketed(durations), _bucketed(latencies)


@functools.cache
def _histogram_query(dialect: str, which: str, bounds: tuple[float, ...]):
    """Built once per histogram: the statement is large, and a scrape must stay cheap."""
    jobs = ValidationJob
    until = bindparam("b_until", type_=jobs.finished_at.type)
    if which == "duration":
        seconds = _seconds_between(dialect, jobs.started_at, jobs.finished_at)
        where = [jobs.status.in_(_TERMINAL), jobs.finished_at <= until]
    else:
        seconds = _seconds_between(dialect, jobs.created_at, jobs.started_at)
        where = [jobs.started_at <= until]
    bucket = case(
        *((seconds <= bound, index) for index, bound in enumerate(bounds)), else_=len(bounds)
    ).label("bucket")
    return (
        select(jobs.pool, bucket, func.count(), func.sum(seconds))
        .where(jobs.started_at.is_not(None), *where)
        .group_by(jobs.pool, bucket)
    )


def _bucketed(rows) -> Buckets:
    found: Buckets = {}
    for pool, bucket, count, total in rows:
        found.setdefault(pool, {})[int(bucket)] = (int(count), float(total or 0.0))
    return found


def _count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _seconds_between(dialect: str, start: Any, end: Any) -> ColumnElement[float]:
    """end - start in seconds; the one place the dialects differ (date arithmetic).
    SQLite's date functions keep milliseconds."""
    if dialect == "postgresql":
        return cast(func.extract("epoch", end - start), Float)
    return (func.julianday(end) - func.julianday(start)) * 86400.0


@dataclasses.dataclass(frozen=True)
class JobTimes:
    """When a job was enqueued, first claimed and ended (what the histograms need)."""

    id: int
    pool: str
    status: str
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


def jobs_changed_since(session: Session, since: dt.datetime) -> list[JobTimes]:
    """Jobs any transition touched after ``since`` (a range of the updated_at index).

    Every transition sets updated_at, so a job first claimed or ended after ``since`` is
    among them.
    """
    jobs = ValidationJob
    rows = session.execute(
        select(
            jobs.id, jobs.pool, jobs.status, jobs.created_at, jobs.started_at, jobs.finished_at
        ).where(jobs.updated_at > since)
    )
    return [JobTimes(*row) for row in rows]


def queue_health(session: Session, now: dt.datetime, grace_s: float) -> QueueHealth:
    """Live and expired leases, and due jobs nobody claimed within ``grace_s``, in one query.

    A scheduler extends its leases every heartbeat and requeues expired ones every tick, so
    a live lease means one served the queue within a lease period, and an expired lease or
    an overdue job means none does now. Only QUEUED and leased rows are read (RUNNING,
    WAITING_FOR_RESOURCES).
    """
    jobs = ValidationJob
    overdue_before = now - dt.timedelta(seconds=grace_s)
    running, queued = jobs.status.in_(_LEASED), jobs.status == _QUEUED
    row = session.execute(
        select(
            _count_if(and_(running, jobs.lease_expires_at > now)),
            _count_if(and_(running, jobs.lease_expires_at <= now)),
            _count_if(and_(queued, jobs.not_before <= overdue_before)),
            func.min(case((and_(queued, jobs.not_before <= now), jobs.not_before))),
        ).where(jobs.status.in_(_ACTIVE))
    ).one()
    oldest = row[3]
    age = (now - _aware(oldest)).total_seconds() if oldest is not None else 0.0
    return QueueHealth(int(row[0]), int(row[1]), int(row[2]), max(age, 0.0))


def longest_resource_waits(session: Session, now: dt.datetime) -> dict[str, float]:
    """Pool -> how long its longest-waiting WAITING_FOR_RESOURCES job has waited."""
    waiting = JobStatus.WAITING_FOR_RESOURCES.value
    rows = session.execute(
        select(ValidationJob.pool, func.min(ValidationJob.waiting_since))
        .where(ValidationJob.status == waiting, ValidationJob.waiting_since.is_not(None))
        .group_by(ValidationJob.pool)
    )
    return {pool: max(0.0, (now - _aware(since)).total_seconds()) for pool, since in rows}


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    """What one /metrics scrape reads, in one session."""

    jobs: list[tuple[str, str, int]]  # (status, pool, jobs)
    runs: dict[str, int]  # run status -> runs
    checkpoints_registered: int
    health: QueueHealth
    changed: list[JobTimes]  # jobs changed since the scrape's cutoff
    waits: dict[str, float]  # pool -> its longest current wait for resources (seconds)
    attempt_costs: list[costs.AttemptCost]  # ended attempts of the jobs changed since


def metrics_snapshot(
    session: Session, *, now: dt.datetime, grace_s: float, changed_since: dt.datetime
) -> MetricsSnapshot:
    return MetricsSnapshot(
        jobs=jobs_by_status_and_pool(session),
        runs=runs_by_status(session),
        checkpoints_registered=checkpoints_registered(session),
        health=queue_health(session, now, grace_s),
        changed=jobs_changed_since(session, changed_since),
        waits=longest_resource_waits(session, now),
        attempt_costs=costs.attempts_of_jobs_changed_since(session, changed_since),
    )
