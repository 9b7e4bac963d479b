"""Checkpoint retention as Determined users know it (save_experiment_best, save_trial_best,
save_trial_latest): which checkpoints go, marking them deleted, and stored policies.

Each attempt of a run counts as one run (Determined's trial) for the per-run rules. Never
deleted: a checkpoint whose validation is QUEUED or RUNNING, one with an alias, and the
one ``latest_checkpoint(run)`` returns. Reads checkpoints and metric values, writes
checkpoints' ``deleted_at`` and retention_policies.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, exists, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput
from validation_service.jobs import ValidationStatus
from validation_service.registry.aliases import upsert
from validation_service.registry.catalog import checkpoint_record
from validation_service.registry.models import (
    Checkpoint,
    CheckpointAlias,
    MetricValue,
    RetentionPolicy,
    Run,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord

# A validation in flight: the checkpoint's mirror of a QUEUED or RUNNING job.
IN_FLIGHT = (ValidationStatus.PENDING.value, ValidationStatus.RUNNING.value)
_CHUNK = 5000


@dataclasses.dataclass(frozen=True)
class RetentionRule:
    """What to keep, by one metric. ``run`` is None for a namespace-wide policy."""

    metric: str
    mode: str = "max"
    keep_best: int = 0
    keep_best_per_run: int = 1
    keep_latest: int = 1
    run: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidInput(f"metric must be a metric name, got {self.metric!r}")
        if self.mode not in ("max", "min"):
            raise InvalidInput(f"mode must be 'max' or 'min', got {self.mode!r}")
        for name in ("keep_best", "keep_best_per_run", "keep_latest"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"{name} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A checkpoint that is not deleted, with what the rules look at."""

    record: CheckpointRecord
    run_id: int
    attempt: int
    storage_root: str
    value: float | None  # the metric's merged, finite value


def candidates(
    session: Session, namespace: str, run: str | None, exclude_runs: Iterable[str] = ()
) -> list[Candidate]:
    """The checkpoints (not deleted) of every attempt of ``run``, or of the namespace."""
    query = (
        select(Checkpoint, Run.name, Run.attempt, Run.storage_root)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.namespace == namespace, Checkpoint.deleted_at.is_(None))
    )
    if run is not None:
        query = query.where(Run.name == run)
    excluded = list(exclude_runs)
    if excluded:
        query = query.where(Run.name.not_in(excluded))
    return [
        Candidate(checkpoint_record(c, name), c.run_id, attempt, root, None)
        for c, name, attempt, root in session.execute(query.order_by(Checkpoint.id))
    ]


def with_values(session: Session, found: list[Candidate], metric: str) -> list[Candidate]:
    values: dict[int, float] = {}
    ids = [candidate.record.id for candidate in found]
    for start in range(0, len(ids), _CHUNK):
        rows = session.execute(
            select(MetricValue.checkpoint_id, MetricValue.value).where(
                MetricValue.checkpoint_id.in_(ids[start : start + _CHUNK]),
                MetricValue.name == metric,
                MetricValue.effective == True,  # noqa: E712 - the merged view's value
            )
        )
        values.update(dict(rows.all()))
    return [dataclasses.replace(c, value=values.get(c.record.id)) for c in found]


def aliased_ids(session: Session, ids: list[int]) -> set[int]:
    found: set[int] = set()
    for start in range(0, len(ids), _CHUNK):
        found.update(
            session.scalars(
                select(CheckpointAlias.checkpoint_id).where(
                    CheckpointAlias.checkpoint_id.in_(ids[start : start + _CHUNK])
                )
            )
        )
    return found


def to_delete(found: list[Candidate], rule: RetentionRule, aliased: set[int]) -> list[Candidate]:
    """The candidates no rule keeps and nothing protects, in checkpoint order."""
    keep: set[int] = set()
    sign = -1.0 if rule.mode == "max" else 1.0

    def best_first(group: list[Candidate]) -> list[Candidate]:
        ranked = [c for c in group if c.value is not None]
        return sorted(ranked, key=lambda c: (sign * c.value, c.record.id))

    keep.update(c.record.id for c in best_first(found)[: rule.keep_best])
    by_attempt: dict[int, list[Candidate]] = defaultdict(list)
    latest_attempt: dict[str, int] = {}
    for candidate in found:
        by_attempt[candidate.run_id].append(candidate)
        run = candidate.record.run
        latest_attempt[run] = max(latest_attempt.get(run, 0), candidate.attempt)
    for group in by_attempt.values():
        keep.update(c.record.id for c in best_first(group)[: rule.keep_best_per_run])
        newest = sorted(group, key=lambda c: -c.record.report_index)
        keep.update(c.record.id for c in newest[: rule.keep_latest])
        # What latest_checkpoint(run) returns: the newest of the run's latest attempt.
        if group[0].attempt == latest_attempt[group[0].record.run]:
            keep.add(newest[0].record.id)
    return [
        c
        for c in found
        if c.record.id not in keep
        and c.record.id not in aliased
        and c.record.validation_status not in IN_FLIGHT
    ]


def mark_deleted(conn: Connection, ids: list[int], now: dt.datetime) -> set[int]:
    """Marks the checkpoints deleted and out of every ranking; returns the ids marked.

    Re-checks in the same transaction what protects a checkpoint: a validation that was
    requeued or an alias that was set since the plan keeps it. On PostgreSQL the rows
    are locked first, so an alias set concurrently either commits before this statement
    sees it, or waits and then finds the checkpoint deleted.
    """
    marked: set[int] = set()
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        conn.execute(select(Checkpoint.id).where(Checkpoint.id.in_(chunk)).with_for_update())
        marked.update(
            conn.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.id.in_(chunk),
                    Checkpoint.deleted_at.is_(None),
                    Checkpoint.validation_status.not_in(IN_FLIGHT),
                    ~exists().where(CheckpointAlias.checkpoint_id == Checkpoint.id),
                )
                .values(deleted_at=now)
                .returning(Checkpoint.id)
            ).scalars()
        )
    done = sorted(marked)
    for start in range(0, len(done), _CHUNK):
        conn.execute(
            update(MetricValue)
            .where(MetricValue.checkpoint_id.in_(done[start : start + _CHUNK]))
            .values(effective=False)
        )
    return marked


# ------------------------------------------------------------------ policies
def save_policy(conn: Connection, namespace: str, rule: RetentionRule) -> None:
    row: dict[str, Any] = {
        "namespace": namespace,
        "run_name": rule.run or "",
        "metric": rule.metric,
        "mode": rule.mode,
        "keep_best": rule.keep_best,
        "keep_best_per_run": rule.keep_best_per_run,
        "keep_latest": rule.keep_latest,
        "updated_at": utcnow(),
    }
    upsert(conn, RetentionPolicy.__table__, row, ["namespace", "run_name"])


def remove_policy(conn: Connection, namespace: str, run: str | None) -> bool:
    return bool(
        conn.execute(
            delete(RetentionPolicy).where(
                RetentionPolicy.namespace == namespace, RetentionPolicy.run_name == (run or "")
            )
        ).rowcount
    )


def policies(session: Session, namespace: str) -> dict[str | None, RetentionRule]:
    """Run name (None: the namespace's own policy) -> its stored rule."""
    rows = session.scalars(select(RetentionPolicy).where(RetentionPolicy.namespace == namespace))
    return {
        (row.run_name or None): RetentionRule(
            metric=row.metric,
            mode=row.mode,
            keep_best=row.keep_best,
            keep_best_per_run=row.keep_best_per_run,
            keep_latest=row.keep_latest,
            run=row.run_name or None,
        )
        for row in rows
    }


def run_of(session: Session, run_id: int) -> tuple[str, str] | None:
    """(namespace, name) of a run attempt, or None if it is gone."""
    row = session.execute(select(Run.namespace, Run.name).where(Run.id == run_id)).first()
    return None if row is None else (row.namespace, row.name)
