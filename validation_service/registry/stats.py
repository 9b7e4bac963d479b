"""Aggregate reads for the dashboard and /metrics: grouped counts, series, durations.

Every function here is one or a few grouped statements over a read session: per-run and
per-pool figures come from GROUP BY, never from a query per row, so a page of runs or a
scrape costs the same at 10 runs as at 1,000.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import Float, and_, case, cast, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from validation_service.jobs import JobStatus
from validation_service.registry.models import Checkpoint, MetricValue, Run, ValidationJob
from validation_service.registry.records import RunRecord, record_from

Mode = Literal["max", "min"]

_QUEUED, _RUNNING = JobStatus.QUEUED.value, JobStatus.RUNNING.value
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
class DurationHistogram:
    """Cumulative bucket counts (one per upper bound, then +Inf), their count and sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int
    total_s: float


@dataclasses.dataclass(frozen=True)
class QueueHealth:
    """What the queue says about whether a scheduler serves it (see queue_health)."""

    live_leases: int  # RUNNING jobs whose lease a scheduler extended recently enough
    expired_leases: int  # RUNNING jobs whose lease ran out and nobody requeued
    overdue_queued: int  # QUEUED jobs due for longer than the grace period, unclaimed
    oldest_due_s: float  # age of the oldest due QUEUED job (0 when none)


# Metric names whose lower values are better; any other metric ranks higher-is-better.
_LOWER_IS_BETTER = (
    "loss",
    "error",
    "err",
    "mse",
    "mae",
    "rmse",
    "perplexity",
    "ppl",
    "wer",
    "cer",
    "latency",
    "time",
    "duration",
    "regret",
    "nll",
)


def default_mode(metric: str) -> Mode:
    """ "min" for metrics named like a loss or an error rate, else "max"."""
    words = metric.lower().replace("-", "_").replace("/", "_").replace(".", "_").split("_")
    return "min" if any(word in _LOWER_IS_BETTER for word in words) else "max"


# ------------------------------------------------------------------ dashboard
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
    the usual direction of the metric's name (see default_mode).
    """
    activity = _last_activity(session, namespace)
    ordered = sorted(activity.items(), key=lambda item: (item[1], item[0]), reverse=True)
    chosen = ordered[(page - 1) * per_page : page * per_page]
    ids = [run_id for run_id, _ in chosen]
    if not ids:
        return RunPage([], page, per_page, len(ordered), [], 0, metric, mode or "max")
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
    active = sum(c.get(_QUEUED, 0) + c.get(_RUNNING, 0) for c in counts.values())
    rows = [
        RunActivity(
            runs[run_id], checkpoints.get(run_id, 0), counts.get(run_id, {}), best.get(run_id), last
        )
        for run_id, last in chosen
    ]
    return RunPage(rows, page, per_page, len(ordered), names, active, metric, mode)


def _last_activity(session: Session, namespace: str) -> dict[int, dt.datetime]:
    """Run id -> the latest of its creation, its newest report and its last job change."""
    reports = (
        select(Checkpoint.run_id, func.max(Checkpoint.created_at).label("at"))
        .group_by(Checkpoint.run_id)
        .subquery()
    )
    jobs = (
        select(ValidationJob.run_id, func.max(ValidationJob.updated_at).label("at"))
        .group_by(ValidationJob.run_id)
        .subquery()
    )
    query = (
        select(Run.id, Run.created_at, reports.c.at, jobs.c.at)
        .outerjoin(reports, reports.c.run_id == Run.id)
        .outerjoin(jobs, jobs.c.run_id == Run.id)
        .where(Run.namespace == namespace)
    )
    # The UTC type of the columns does not reach a subquery's max(): make those aware here.
    return {
        run_id: max(_aware(t) for t in (created, reported, changed) if t is not None)
        for run_id, created, reported, changed in session.execute(query)
    }


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
    run = session.scalar(select(Run).where(Run.namespace == namespace, Run.name == name))
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
                ValidationJob.status.in_([_QUEUED, _RUNNING]),
            )
        )
        or 0
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


def job_durations(
    session: Session, duration_bounds: Sequence[float], latency_bounds: Sequence[float]
) -> tuple[dict[str, DurationHistogram], dict[str, DurationHistogram]]:
    """Per pool: the validation duration (first claim -> finish, of terminal jobs) and the
    dispatch latency (enqueue -> first claim) histograms, bucketed in SQL in one query.

    The database returns a few sums per pool instead of a row per job, so a scrape reads
    the job rows once and ships a handful of numbers, whatever the number of jobs.
    """
    duration = _seconds_between(session, ValidationJob.started_at, ValidationJob.finished_at)
    latency = _seconds_between(session, ValidationJob.created_at, ValidationJob.started_at)
    finished = and_(ValidationJob.status.in_(_TERMINAL), ValidationJob.finished_at.is_not(None))
    columns: list[Any] = [ValidationJob.pool]
    for seconds, bounds, where in (
        (duration, duration_bounds, finished),
        (latency, latency_bounds, True),
    ):
        counted = and_(where, seconds.is_not(None))
        columns += [_count_if(and_(counted, seconds <= bound)) for bound in bounds]
        columns += [_count_if(counted), func.coalesce(func.sum(case((counted, seconds))), 0.0)]
    rows = session.execute(
        select(*columns).where(ValidationJob.started_at.is_not(None)).group_by(ValidationJob.pool)
    ).all()
    durations, latencies = {}, {}
    n_duration = len(duration_bounds) + 2
    for row in rows:
        pool, values = row[0], row[1:]
        durations[pool] = _histogram(duration_bounds, values[:n_duration])
        latencies[pool] = _histogram(latency_bounds, values[n_duration:])
    return durations, latencies


def _histogram(bounds: Sequence[float], values: Sequence[Any]) -> DurationHistogram:
    *buckets, count, total = values
    return DurationHistogram(
        tuple(bounds), (*map(int, buckets), int(count)), int(count), float(total or 0.0)
    )


def _count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _seconds_between(session: Session, start: Any, end: Any) -> ColumnElement[float]:
    """end - start in seconds; the one place the dialects differ (date arithmetic)."""
    if session.get_bind().dialect.name == "postgresql":
        return cast(func.extract("epoch", end - start), Float)
    return (func.julianday(end) - func.julianday(start)) * 86400.0


def queue_health(session: Session, now: dt.datetime, grace_s: float) -> QueueHealth:
    """Live and expired leases, and due jobs nobody claimed within ``grace_s``, in one query.

    A scheduler extends its leases every heartbeat and requeues expired ones every tick, so
    a live lease means one served the queue within a lease period, and an expired lease or
    an overdue job means none does now. Only QUEUED and RUNNING rows are read.
    """
    jobs = ValidationJob
    overdue_before = now - dt.timedelta(seconds=grace_s)
    running, queued = jobs.status == _RUNNING, jobs.status == _QUEUED
    row = session.execute(
        select(
            _count_if(and_(running, jobs.lease_expires_at > now)),
            _count_if(and_(running, jobs.lease_expires_at <= now)),
            _count_if(and_(queued, jobs.not_before <= overdue_before)),
            func.min(case((and_(queued, jobs.not_before <= now), jobs.not_before))),
        ).where(jobs.status.in_([_QUEUED, _RUNNING]))
    ).one()
    oldest = row[3]
    age = (now - _aware(oldest)).total_seconds() if oldest is not None else 0.0
    return QueueHealth(int(row[0]), int(row[1]), int(row[2]), max(age, 0.0))


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    """Everything one /metrics scrape reports, read in one session."""

    jobs: list[tuple[str, str, int]]  # (status, pool, jobs)
    runs: dict[str, int]  # run status -> runs
    checkpoints_registered: int
    durations: dict[str, DurationHistogram]  # pool -> validation duration
    dispatch_latencies: dict[str, DurationHistogram]  # pool -> enqueue -> first claim
    health: QueueHealth


def metrics_snapshot(
    session: Session,
    *,
    duration_bounds: Sequence[float],
    latency_bounds: Sequence[float],
    now: dt.datetime,
    grace_s: float,
) -> MetricsSnapshot:
    durations, latencies = job_durations(session, duration_bounds, latency_bounds)
    return MetricsSnapshot(
        jobs=jobs_by_status_and_pool(session),
        runs=runs_by_status(session),
        checkpoints_registered=checkpoints_registered(session),
        durations=durations,
        dispatch_latencies=latencies,
        health=queue_health(session, now, grace_s),
    )
