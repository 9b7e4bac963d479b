"""Checkpoint retention as Determined users know it (save_experiment_best, save_trial_best,
save_trial_latest): which checkpoints go, marking them deleted, and stored policies.

Each attempt of a run counts as one run (Determined's trial) for the per-run rules. Never
deleted: a checkpoint whose validation is QUEUED or RUNNING, one with an alias, and the
one ``latest_checkpoint(run)`` returns. Files are removed only under the storage roots the
settings name, inside the checkpoint's own run folder, and never from a folder that
another checkpoint record still uses. Reads
checkpoints and metric values, writes checkpoints' ``deleted_at`` and retention_policies.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import exists, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput
from validation_service.jobs import ValidationStatus
from validation_service.registry.aliases import upsert
from validation_service.registry.catalog import RECORD_COLUMNS, checkpoint_record
from validation_service.registry.models import (
    Checkpoint,
    CheckpointAlias,
    MetricValue,
    RetentionPolicy,
    Run,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord
from validation_service.secrets import mask_url
from validation_service.validation import INT32_MAX

logger = logging.getLogger(__name__)

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
            if value > INT32_MAX:  # a policy's columns are 32-bit; more keeps everything
                raise InvalidInput(
                    f"{name} must be at most {INT32_MAX} (a larger number keeps every "
                    f"checkpoint as that does), got {value!r}"
                )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A checkpoint that is not deleted, with what the rules look at."""

    record: CheckpointRecord
    run_id: int
    attempt: int
    storage_root: str
    value: float | None  # the metric's merged, finite value


def candidates(
    session: Session | Connection,
    namespace: str,
    run: str | None,
    exclude_runs: Iterable[str] = (),
) -> list[Candidate]:
    """The checkpoints (not deleted) of every attempt of ``run``, or of the namespace."""
    query = (
        select(
            *RECORD_COLUMNS,
            Checkpoint.run_id,
            Run.name.label("run_name"),
            Run.attempt.label("run_attempt"),
            Run.storage_root,
        )
        .join(Run, Run.id == Checkpoint.run_id)
        .where(
            Run.namespace == namespace,
            Checkpoint.deleted_at.is_(None),
            # A folder added by register() is not ckval's to delete, whatever the rule.
            Checkpoint.external.is_(False),
        )
    )
    if run is not None:
        query = query.where(Run.name == run)
    excluded = list(exclude_runs)
    if excluded:
        query = query.where(Run.name.not_in(excluded))
    return [
        Candidate(checkpoint_record(c, c.run_name), c.run_id, c.run_attempt, c.storage_root, None)
        for c in session.execute(query.order_by(Checkpoint.id))
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


def shared_folders(session: Session, deleted: list[Candidate]) -> set[int]:
    """Ids of the deleted checkpoints whose folder a checkpoint record that is not
    deleted still uses: its URI is that folder, lies inside it, or contains it."""
    used = used_folders(session, [c.record.uri for c in deleted])
    return {c.record.id for c in deleted if c.record.uri.rstrip("/") in used}


def used_folders(session: Session, uris: list[str]) -> set[str]:
    """The folders among ``uris`` (without a trailing '/') that a checkpoint record that
    is not deleted uses: its URI is that folder, lies inside it, or contains it."""
    used_ones: set[str] = set()
    for start in range(0, len(uris), 200):
        chunk = {uri.rstrip("/") for uri in uris[start : start + 200]}
        ancestors = {a for uri in chunk for a in _ancestors(uri)}
        rows = session.scalars(
            select(Checkpoint.uri).where(
                Checkpoint.deleted_at.is_(None),
                or_(
                    Checkpoint.uri.in_(sorted(ancestors | chunk)),
                    *[Checkpoint.uri.startswith(u + "/", autoescape=True) for u in chunk],
                ),
            )
        )
        used = {uri.rstrip("/") for uri in rows}
        for uri in chunk:
            if uri in used or used & set(_ancestors(uri)) or any(_under(u, uri) for u in used):
                used_ones.add(uri)
    return used_ones


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    """What a retention rule does now: the checkpoints it deletes, and those it would
    delete but keeps because their files lie outside the storage roots the settings name
    (Settings.deletion_roots): their rows and files stay as they are."""

    deleting: list[CheckpointRecord]
    kept_outside: list[CheckpointRecord]


KEPT_OUTSIDE = "outside the configured storage: kept"


def split_by_storage(
    going: list[Candidate], roots: list[str], storage_options: dict
) -> tuple[list[Candidate], list[Candidate]]:
    """(deletable, kept): a candidate is deletable only when its run's storage root and
    its own folder (local: after resolving symlinks) lie under one of ``roots``, the
    storage roots of the deleting process's own settings, never a root a reporter chose."""
    from validation_service.storage import CheckpointStorage

    storages = [CheckpointStorage(root, storage_options) for root in roots]
    deletable, kept = [], []
    for candidate in going:
        inside = any(_holds(storage, candidate) for storage in storages)
        (deletable if inside else kept).append(candidate)
    for candidate in kept:
        record = candidate.record
        logger.warning(
            "checkpoint %d of run %r at %s: %s (its storage root %s is not CKVAL_STORAGE "
            "nor in CKVAL_DELETABLE_ROOTS)",
            *(record.report_index, record.run, mask_url(record.uri), KEPT_OUTSIDE),
            mask_url(candidate.storage_root),
        )
    return deletable, kept


def _holds(storage, candidate: Candidate) -> bool:
    try:
        storage.path_of(candidate.record.uri)  # strictly inside, symlinks resolved
    except InvalidInput:
        return False
    except Exception:  # noqa: BLE001 - a URI no filesystem reads is not under the root
        return False
    return storage.in_root(candidate.storage_root)


def delete_files(
    deleted: list[Candidate], shared: set[int], namespace: str, storage_options: dict
) -> None:
    """Removes deleted checkpoints' folders, each only inside its own run's folder and
    only when no other record uses it (``shared``). A checkpoint registered in place
    outside the storage root (NO_UPLOAD) keeps its files. A failure is logged; the rows
    stay marked deleted."""
    from validation_service.storage import CheckpointStorage

    storages: dict[str, CheckpointStorage] = {}
    for candidate in deleted:
        record = candidate.record
        try:
            root = candidate.storage_root
            if root not in storages:
                storages[root] = CheckpointStorage(root, storage_options)
            if not storages[root].in_root(record.uri):
                logger.info(
                    "checkpoint %d of run %r lies outside the storage root (registered in "
                    "place): its files at %s are left where they are",
                    *(record.report_index, record.run, record.uri),
                )
            elif record.id in shared:
                logger.warning(
                    "checkpoint %d of run %r is marked deleted, but another checkpoint record "
                    "uses its folder %s: its files are left where they are",
                    *(record.report_index, record.run, record.uri),
                )
            else:
                storages[root].delete(record.uri, namespace=namespace, run=record.run)
        except Exception as exc:  # noqa: BLE001 - the row is marked; say what is left
            logger.warning(
                "checkpoint %d of run %r is marked deleted but its files at %s could "
                "not be removed (%s: %s); remove them by hand",
                *(record.report_index, record.run, record.uri, type(exc).__name__, exc),
            )


def _ancestors(uri: str) -> list[str]:
    parts = uri.split("/")
    return ["/".join(parts[:end]) for end in range(len(parts) - 1, 0, -1) if parts[end - 1]]


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder + "/")


# ------------------------------------------------------------------ policies
def save_policy(conn: Connection, namespace: str, rule: RetentionRule) -> None:
    row: dict[str, Any] = {name: getattr(rule, name) for name in _POLICY_COLUMNS}
    row.update(namespace=namespace, run_name=rule.run or "", updated_at=utcnow())
    upsert(conn, RetentionPolicy.__table__, row, ["namespace", "run_name"])


def policies(session: Session | Connection, namespace: str) -> dict[str | None, RetentionRule]:
    """Run name (None: the namespace's own policy) -> its stored rule."""
    table = RetentionPolicy.__table__
    rows = session.execute(select(table).where(table.c.namespace == namespace))
    return {
        (row.run_name or None): RetentionRule(
            **{name: getattr(row, name) for name in _POLICY_COLUMNS}, run=row.run_name or None
        )
        for row in rows
    }


# The rule's fields stored under the same names (``run`` is stored as run_name).
_POLICY_COLUMNS = ("metric", "mode", "keep_best", "keep_best_per_run", "keep_latest")
