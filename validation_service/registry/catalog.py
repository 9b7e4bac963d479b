"""The checkpoint catalog's statements: runs, checkpoints, their metric values, report
indices, best-k, and the merge of validated metrics. Reads and writes runs, checkpoints
and metric_values only, always in its caller's transaction (it opens none)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput, RunNotFound
from validation_service.jobs import DEFAULT_VALIDATOR, MetricSource, RunStatus
from validation_service.metrics import rankable
from validation_service.names import check_name
from validation_service.registry.aliases import tag_conditions
from validation_service.registry.database import Database
from validation_service.registry.limits import KNOWN_METRICS_ROWS, KNOWN_RUN_NAMES
from validation_service.registry.models import (
    Checkpoint,
    CheckpointAlias,
    MetricValue,
    Run,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord, RunRecord, record_from

Mode = Literal["max", "min"]


@dataclasses.dataclass(frozen=True)
class Ranking:
    """What a best-k read ranks by: the top ``k`` checkpoints by ``metric`` ("max":
    highest first), among those with every tag of ``tags``, by the default validation's
    merged values or by a named ``validator``'s."""

    metric: str
    mode: Mode = "max"
    k: int = 1
    tags: dict[str, str] | None = None
    validator: str = DEFAULT_VALIDATOR


_checkpoints, _values, _runs = Checkpoint.__table__, MetricValue.__table__, Run.__table__


class NamespaceRoom:
    """A room whose operations run one namespace's catalog statements on the database,
    each in one transaction of its own (the Ledger, the Assemblies, the DashboardReader)."""

    def __init__(self, db: Database, catalog: Catalog):
        self.db = db
        self.catalog = catalog


class Catalog:
    """The statements over one namespace's runs, checkpoints and metric values.

    Each runs in the caller's transaction (a Session or a Connection): the room that owns
    an operation (the Registry, the Ledger, the JobQueue...) opens the one transaction it
    takes, and calls these inside it.
    """

    def __init__(self, namespace: str):
        self.namespace = namespace

    # ------------------------------------------------------------------- runs
    def latest_attempt(self, conn: Connection | Session, name: str) -> Row | None:
        """(id, attempt, status, ended_at) of the run's latest attempt, or None."""
        check_run_name(name)
        return conn.execute(self._latest_attempt_query(name)).first()

    def insert_run(
        self,
        conn: Connection,
        name: str,
        *,
        storage_root: str,
        tags: dict[str, Any] | None,
        attempt: int,
        status: RunStatus = RunStatus.RUNNING,
    ) -> int:
        """Adds attempt ``attempt`` of the run; IntegrityError when another writer did."""
        now = utcnow()
        row = {
            "name": name,
            "namespace": self.namespace,
            "storage_root": storage_root,
            "tags": tags or {},
            "created_at": now,
            "status": status.value,
            "attempt": attempt,
            "ended_at": None if status is RunStatus.RUNNING else now,
        }
        return conn.execute(_INSERT_RUN, row).scalar_one()

    def reopen(self, conn: Connection, run_id: int) -> None:
        """An ended attempt RUNNING again (reports go on in it)."""
        conn.execute(
            update(_runs)
            .where(_runs.c.id == run_id)
            .values(status=RunStatus.RUNNING.value, ended_at=None)
        )

    def end_run(self, conn: Connection, run_id: int, status: RunStatus) -> bool:
        """Ends the attempt if it is RUNNING; False if it was not."""
        changed = conn.execute(
            update(_runs)
            .where(_runs.c.id == run_id, _runs.c.status == RunStatus.RUNNING.value)
            .values(status=status.value, ended_at=utcnow())
        ).rowcount
        return bool(changed)

    def run_tags(
        self, conn: Connection | Session, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        """The tags of the named run's latest attempt ({} when there is no such run)."""
        query = (
            select(Run.tags)
            .where(Run.namespace == (namespace or self.namespace), Run.name == name)
            .order_by(Run.attempt.desc())
            .limit(1)
        )
        return dict(conn.scalar(query) or {})

    def merge_run_tags(self, conn: Connection, run_id: int, tags: dict[str, Any]) -> None:
        """Sets these tags of the run, keeping its others."""
        current = conn.execute(select(_runs.c.tags).where(_runs.c.id == run_id)).scalar_one()
        merged = {**(current or {}), **tags}
        conn.execute(update(_runs).where(_runs.c.id == run_id).values(tags=merged))

    def run_id(self, conn: Connection | Session, name: str) -> int | None:
        """The id of the named run's latest attempt, or None."""
        check_run_name(name)
        return conn.scalar(self._run_id_query(name))

    def runs(self, session: Session) -> list[RunRecord]:
        rows = session.scalars(self._runs_query()).all()
        return [run_record(r) for r in rows]

    def _runs_query(self):
        """Every run attempt of the namespace, in id order (the CLI's fast read runs it too)."""
        return select(Run).where(Run.namespace == self.namespace).order_by(Run.id)

    def checkpoint_counts(self, session: Session) -> dict[int, int]:
        """Run id -> its checkpoints that are not deleted, for every run of the namespace."""
        return dict(session.execute(self._checkpoint_counts_query()).all())

    def _checkpoint_counts_query(self):
        """(run id, live checkpoints) per run of the namespace (the CLI's fast read runs it
        too)."""
        return (
            select(Checkpoint.run_id, func.count(Checkpoint.id))
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Run.namespace == self.namespace, Checkpoint.deleted_at.is_(None))
            .group_by(Checkpoint.run_id)
        )

    def require_run_id(
        self, session: Connection | Session, name: str, attempt: int | None = None
    ) -> int:
        """The id of the run's latest attempt (or of ``attempt``); RunNotFound if none."""
        run_id = session.scalar(self._run_id_query(name, attempt))
        if run_id is None and attempt is not None and session.scalar(self._run_id_query(name)):
            raise InvalidInput(
                f"run {name!r} has no attempt {attempt}; `ckval runs` lists its attempts"
            )
        if run_id is None:
            known = session.scalars(self._known_names_query()).all()
            raise RunNotFound(name, self.namespace, list(known))
        return run_id

    def _run_id_query(self, name: str, attempt: int | None = None):
        query = select(Run.id).where(Run.namespace == self.namespace, Run.name == name)
        if attempt is not None:
            return query.where(Run.attempt == attempt)
        return query.order_by(Run.attempt.desc()).limit(1)

    def _known_names_query(self):
        """The run names a RunNotFound suggests (the CLI's fast read runs it too)."""
        return select(Run.name).where(Run.namespace == self.namespace).limit(KNOWN_RUN_NAMES)

    def _latest_attempt_query(self, name: str):
        return (
            select(Run.id, Run.attempt, Run.status, Run.ended_at)
            .where(Run.namespace == self.namespace, Run.name == name)
            .order_by(Run.attempt.desc())
            .limit(1)
        )

    # --------------------------------------------------------- report indices
    def next_report_index(self, conn: Connection | Session, run_id: int) -> int:
        """The index the run's next reservation gets (reserves nothing)."""
        current = conn.scalar(select(Run.next_report_index).where(Run.id == run_id))
        if current is None:
            raise RunNotFound(f"id {run_id}", self.namespace)
        return current

    def reserve_report_index(self, conn: Connection, run_id: int) -> int:
        """Reserves the run's next report index for one report, atomically.

        One ``UPDATE ... RETURNING`` on the run's row: concurrent reporters, in any
        number of processes, each get an index of their own, in the order they ask.
        """
        following = conn.execute(_RESERVE_REPORT_INDEX, {"b_run_id": run_id}).scalar()
        if following is None:
            raise RunNotFound(f"id {run_id}", self.namespace)
        return following - 1

    # ---------------------------------------------------------- checkpoints
    def find_checkpoint(
        self, conn: Connection | Session, run_id: int, report_index: int
    ) -> tuple[int, str, str] | None:
        """(id, uri, run name) of the run's checkpoint at a report index, or None."""
        row = conn.execute(
            select(Checkpoint.id, Checkpoint.uri, Run.name)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Checkpoint.run_id == run_id, Checkpoint.report_index == report_index)
        ).first()
        return None if row is None else tuple(row)

    def checkpoints(
        self,
        conn: Connection | Session,
        run_id: int,
        run: str,
        *,
        include_deleted: bool,
        tags: dict[str, str] | None = None,
    ) -> list[CheckpointRecord]:
        """The run attempt's checkpoints in report order (only those with every tag)."""
        query = checkpoints_query(run_id, include_deleted=include_deleted)
        if tags:
            query = query.where(*tag_conditions(tags))
        return [checkpoint_record(c, run) for c in conn.execute(query).all()]

    def latest(
        self, conn: Connection | Session, run_id: int, run: str, before: int | None = None
    ) -> CheckpointRecord | None:
        """The run attempt's newest checkpoint that is not deleted (reported before the
        report index ``before``, if given), or None."""
        query = select(*RECORD_COLUMNS).where(
            Checkpoint.run_id == run_id, Checkpoint.deleted_at.is_(None)
        )
        if before is not None:
            query = query.where(Checkpoint.report_index < before)
        row = conn.execute(query.order_by(Checkpoint.report_index.desc()).limit(1)).first()
        return None if row is None else checkpoint_record(row, run)

    def aliased(
        self, conn: Connection | Session, run_id: int, run: str, alias: str
    ) -> CheckpointRecord | None:
        """The checkpoint the run attempt's ``alias`` points at (deleted or not), or None."""
        row = conn.execute(
            select(*RECORD_COLUMNS)
            .join(CheckpointAlias, CheckpointAlias.checkpoint_id == Checkpoint.id)
            .where(CheckpointAlias.run_id == run_id, CheckpointAlias.alias == alias)
        ).first()
        return None if row is None else checkpoint_record(row, run)

    def best(
        self, session: Session | Connection, run_id: int | None, ranking: Ranking
    ) -> list[CheckpointRecord]:
        """Top-k by the effective (merged, finite) values of a metric; ties: earlier report.

        ``run_id``: one attempt of a run, or None for every run of the namespace.
        """
        metric, mode, k, tags = ranking.metric, ranking.mode, ranking.k, ranking.tags
        if mode not in ("max", "min"):
            raise InvalidInput(f"mode must be 'max' or 'min', got {mode!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidInput(f"k must be a positive int, got {k!r}")
        params = {"b_metric": metric, "b_namespace": self.namespace, "b_run_id": run_id, "b_k": k}
        query = _best_query(mode, run_id is not None)
        if tags:
            query = query.where(*tag_conditions(tags))
        rows = session.execute(query, params).all()
        return [checkpoint_record(row, row.run_name) for row in rows]

    def known_metrics(self, session: Session, run_id: int | None) -> set[str]:
        """Names of the metrics recorded for the run (any run of the namespace: None)."""
        known: set[str] = set()
        for reported, validated in session.execute(self._known_metrics_query(run_id)):
            known.update(reported or {})
            known.update(validated or {})
        return known

    def _known_metrics_query(self, run_id: int | None):
        """The rows known_metrics reads (the CLI's fast read runs it too)."""
        query = select(Checkpoint.reported_metrics, Checkpoint.validated_metrics)
        if run_id is not None:
            query = query.where(Checkpoint.run_id == run_id)
        else:
            query = query.join(Run).where(Run.namespace == self.namespace)
        return query.limit(KNOWN_METRICS_ROWS)

    def merge_validated(self, conn: Connection, job: Row, validated: dict[str, Any]) -> dict:
        """Ranks a job's validated metrics (``job``: a transitions.running_job row); returns
        the checkpoint's new metric columns, for the job's finish to set with its status."""
        # Re-validation replaces the earlier validated values instead of adding to them.
        conn.execute(_DELETE_VALIDATED_VALUES, {"b_checkpoint_id": job.checkpoint_id})
        # A validated value hides the reported one of the same name; a checkpoint deleted
        # while it was validated stays out of every ranking.
        ranked = job.deleted_at is None
        if not ranked:
            effective: Any = False
        elif validated:
            effective = _values.c.name.not_in(list(validated))
        else:
            effective = True
        conn.execute(
            update(_values)
            .where(_values.c.checkpoint_id == job.checkpoint_id)
            .values(effective=effective)
        )
        values = metric_rows(
            job.checkpoint_id, job.run_id, validated, MetricSource.VALIDATED, effective=ranked
        )
        if values:
            conn.execute(_INSERT_METRIC_VALUE, values)
        return {"validated_metrics": validated, "metrics": {**job.reported_metrics, **validated}}


@functools.cache
def _best_query(mode: Mode, by_run: bool):
    """Top-k by one metric, built once per (mode, one run or all): best-k is the hot read.

    One statement: the metric index gives the order, the joins add the rows.
    """
    order = MetricValue.value.desc() if mode == "max" else MetricValue.value.asc()
    conditions = [
        MetricValue.name == bindparam("b_metric"),
        # "= true", not "IS true": only an equality lets the index give the order.
        MetricValue.effective == True,  # noqa: E712
        Run.namespace == bindparam("b_namespace"),
    ]
    if by_run:
        conditions.append(MetricValue.run_id == bindparam("b_run_id"))
    return (
        select(*RECORD_COLUMNS, Run.name.label("run_name"))
        .join(MetricValue, MetricValue.checkpoint_id == Checkpoint.id)
        .join(Run, Run.id == MetricValue.run_id)
        .where(*conditions)
        .order_by(order, MetricValue.checkpoint_id.asc())
        .limit(bindparam("b_k"))
    )


def checkpoints_query(run_id: Any, *, include_deleted: bool):
    """A run attempt's checkpoints (the live ones unless ``include_deleted``) in report
    order, as RECORD_COLUMNS (the CLI's fast read runs it too)."""
    query = select(*RECORD_COLUMNS).where(Checkpoint.run_id == run_id)
    if not include_deleted:
        query = query.where(Checkpoint.deleted_at.is_(None))
    return query.order_by(Checkpoint.report_index)


def checkpoint_row(
    run_id, report_index, step, epoch, uri, size_bytes, manifest_sha256, metrics
) -> dict[str, Any]:
    """A checkpoints row; the caller sets created_at and validation_status."""
    return {
        "run_id": run_id,
        "report_index": report_index,
        "step": step,
        "epoch": epoch,
        "uri": uri,
        "size_bytes": size_bytes,
        "manifest_sha256": manifest_sha256,
        "created_at": None,
        "reported_metrics": metrics,
        "metrics": metrics,
        "validation_status": None,
        "deleted_at": None,
        "external": False,
    }


def metric_rows(
    checkpoint_id: int,
    run_id: int,
    metrics: dict[str, Any],
    source: MetricSource,
    *,
    effective: bool = True,
) -> list[dict[str, Any]]:
    return [
        {
            "checkpoint_id": checkpoint_id,
            "run_id": run_id,
            "name": name,
            "source": source.value,
            "value": value,
            "effective": effective,
        }
        for name, value in rankable(metrics).items()
    ]


def check_run_name(name: str) -> None:
    """Refuses a run name that is no safe storage folder name (see names.check_name)."""
    check_name("run name", name)


def run_record(run: Run) -> RunRecord:
    return record_from(RunRecord, run)


def checkpoint_record(c: Row, run: str) -> CheckpointRecord:
    """A record from a row of RECORD_COLUMNS (a plain row: no ORM object to build)."""
    return record_from(CheckpointRecord, c, run=run, aliases=(), tags={}, evaluations={})


# The record's fields that are checkpoints columns (not run, aliases, tags).
RECORD_COLUMNS = tuple(
    _checkpoints.c[f.name] for f in dataclasses.fields(CheckpointRecord) if f.name in _checkpoints.c
)


# Statements built once, values bound per call (SQLAlchemy then reuses the compiled form
# instead of rebuilding it from .values()).
_INSERT_RUN = insert(_runs).returning(_runs.c.id)
_RESERVE_REPORT_INDEX = (
    update(_runs)
    .where(_runs.c.id == bindparam("b_run_id"))
    .values(next_report_index=_runs.c.next_report_index + 1)
    .returning(_runs.c.next_report_index)
)
_INSERT_METRIC_VALUE = insert(_values)
_DELETE_VALIDATED_VALUES = delete(_values).where(
    _values.c.checkpoint_id == bindparam("b_checkpoint_id"),
    _values.c.source == MetricSource.VALIDATED.value,
)
