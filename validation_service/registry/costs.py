"""What validations cost: the accelerator-seconds each attempt held (accelerators x running
time, migration 0009), summed by run, validator, pool and accelerator type. Each function
runs in its caller's session; a run page sums its own jobs' attempts (records.ValidationCost).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from sqlalchemy import Float, func, literal_column, select
from sqlalchemy.orm import Session

from validation_service.registry.models import Checkpoint, Run, ValidationAttempt, ValidationJob
from validation_service.registry.records import ValidationCost, costs_by_run

_attempts, _jobs, _runs = ValidationAttempt.__table__, ValidationJob.__table__, Run.__table__
_checkpoints = Checkpoint.__table__
# A literal zero (not a bound parameter): the CLI's fast read binds the namespace only.
_ACCELERATOR_S = func.coalesce(_attempts.c.accelerators, literal_column("0.0", Float)) * (
    _attempts.c.running_s
)
# The groups of ValidationCost.of_rows, after what a statement groups by first.
_GROUPS = (_jobs.c.validator, _jobs.c.pool, _attempts.c.accelerator_type)


def cost_by_run_query(namespace: str):
    """(run id, validator, pool, accelerator type, attempts, running seconds,
    accelerator-seconds) of the namespace's runs, over the attempts whose running time is
    known (the CLI's fast read runs it too)."""
    return (
        select(
            _jobs.c.run_id,
            *_GROUPS,
            func.count(_attempts.c.id),
            func.sum(_attempts.c.running_s),
            func.sum(_ACCELERATOR_S),
        )
        .join(_jobs, _jobs.c.id == _attempts.c.job_id)
        .join(_runs, _runs.c.id == _jobs.c.run_id)
        .where(_runs.c.namespace == namespace, _attempts.c.running_s.is_not(None))
        .group_by(_jobs.c.run_id, *_GROUPS)
    )


def cost_by_checkpoint_query(run_id: int):
    """(report index, validator, pool, accelerator type, attempts, running seconds,
    accelerator-seconds) of one run attempt's checkpoints (the CLI's fast read runs it
    too)."""
    return (
        select(
            _checkpoints.c.report_index,
            *_GROUPS,
            func.count(_attempts.c.id),
            func.sum(_attempts.c.running_s),
            func.sum(_ACCELERATOR_S),
        )
        .join(_jobs, _jobs.c.id == _attempts.c.job_id)
        .join(_checkpoints, _checkpoints.c.id == _jobs.c.checkpoint_id)
        .where(_jobs.c.run_id == run_id, _attempts.c.running_s.is_not(None))
        .group_by(_checkpoints.c.report_index, *_GROUPS)
    )


def cost_by_checkpoint(session: Session, run_id: int) -> dict[int, ValidationCost]:
    """Report index -> what the validations of that checkpoint held, in one query."""
    return costs_by_run(session.execute(cost_by_checkpoint_query(run_id)))


def cost_by_run(session: Session, namespace: str) -> dict[int, ValidationCost]:
    """Run id -> what its validations held, for every run of the namespace, in one query."""
    return costs_by_run(session.execute(cost_by_run_query(namespace)))


# ------------------------------------------------------------------ /metrics
@dataclasses.dataclass(frozen=True)
class AttemptCost:
    """One ended attempt as /metrics counts it: its labels and accelerator-seconds."""

    id: int
    pool: str
    validator: str
    accelerator_type: str | None
    finished_at: dt.datetime
    accelerator_s: float


def accelerator_totals(
    session: Session, until: dt.datetime
) -> list[tuple[str, str, str | None, float]]:
    """(pool, validator, accelerator type, accelerator-seconds) of the attempts that
    ended at or before ``until``, in one grouped query (/metrics' first scrape)."""
    rows = session.execute(
        select(
            _jobs.c.pool, _jobs.c.validator, _attempts.c.accelerator_type, func.sum(_ACCELERATOR_S)
        )
        .join(_jobs, _jobs.c.id == _attempts.c.job_id)
        .where(_attempts.c.running_s.is_not(None), _attempts.c.finished_at <= until)
        .group_by(_jobs.c.pool, _jobs.c.validator, _attempts.c.accelerator_type)
    )
    return [(pool, validator, kind, float(total or 0.0)) for pool, validator, kind, total in rows]


def attempts_of_jobs_changed_since(session: Session, since: dt.datetime) -> list[AttemptCost]:
    """The ended attempts, with their running time known, of the jobs any transition
    touched after ``since`` (a range of the jobs' updated_at index): an attempt's end and
    record_usage both touch its job."""
    rows = session.execute(
        select(
            _attempts.c.id,
            _jobs.c.pool,
            _jobs.c.validator,
            _attempts.c.accelerator_type,
            _attempts.c.finished_at,
            _ACCELERATOR_S,
        )
        .join(_jobs, _jobs.c.id == _attempts.c.job_id)
        .where(
            _jobs.c.updated_at > since,
            _attempts.c.running_s.is_not(None),
            _attempts.c.finished_at.is_not(None),
        )
    )
    return [AttemptCost(*row[:5], float(row[5] or 0.0)) for row in rows]
