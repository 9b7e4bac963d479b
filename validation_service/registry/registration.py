"""Registration: a checkpoint's row, its reported metric values and, with a validation
request, its QUEUED job, written together by one named statement per dialect.

PostgreSQL: ``postgresql_registration``, one statement of data-modifying CTEs (the job's
wake-up included), which is its own transaction: one round trip. SQLite:
``register_on_sqlite``, the same rows by four statements in the caller's write
transaction (SQLite has no data-modifying CTEs; its round trips are function calls).

Also here: many stored checkpoints imported at once, without jobs (``import_rows``).
The caller (the Ledger, or Registry.register) opens the transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    String,
    bindparam,
    func,
    insert,
    literal,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from validation_service.jobs import MetricSource
from validation_service.metrics import rankable
from validation_service.registry import raw_sql, transitions, wakeups
from validation_service.registry.catalog import checkpoint_row, metric_rows
from validation_service.registry.models import (
    Checkpoint,
    MetricValue,
    Run,
    ValidationJob,
    utcnow,
)
from validation_service.request import ValidationRequest

_checkpoints, _values, _runs, _jobs = (
    Checkpoint.__table__,
    MetricValue.__table__,
    Run.__table__,
    ValidationJob.__table__,
)


def register(
    conn: Connection, row: dict[str, Any], request: ValidationRequest | None
) -> tuple[int, int | None]:
    """Writes a checkpoints row (catalog.checkpoint_row, with created_at and
    validation_status set), its metric values and, with a request, its QUEUED job;
    returns (checkpoint id, job id or None). The run's report counter is moved past the
    row's index when no reservation did (an index chosen by the caller)."""
    if conn.dialect.name == "postgresql":
        params = _postgresql_parameters(row, request)
        checkpoint_id, job_id, *_ = conn.execute(
            postgresql_registration(request is not None), params
        ).one()
        return checkpoint_id, job_id
    return register_on_sqlite(conn, row, request)


def register_on_sqlite(
    conn: Connection, row: dict[str, Any], request: ValidationRequest | None
) -> tuple[int, int | None]:
    """SQLite's registration: the rows of postgresql_registration, statement by statement."""
    checkpoint_id = conn.execute(_INSERT_CHECKPOINT, row).scalar_one()
    values = metric_rows(checkpoint_id, row["run_id"], row["metrics"], MetricSource.REPORTED)
    if values:
        conn.execute(_INSERT_METRIC_VALUES, values)
    conn.execute(
        _MOVE_COUNTER_PAST, {"b_run_id": row["run_id"], "b_report_index": row["report_index"]}
    )
    if request is None:
        return checkpoint_id, None
    job_row = transitions.enqueue_row(
        request, checkpoint_id, row["run_id"], row["report_index"], row["created_at"]
    )
    # The wake-up of wakeups.py is PostgreSQL's: SQLite replicas poll.
    return checkpoint_id, conn.execute(_INSERT_JOB, job_row).scalar_one()


@functools.cache
def postgresql_registration(with_job: bool):
    """PostgreSQL: a checkpoint, its metric values and its job in one statement, chained
    by data-modifying CTEs. A statement is atomic by itself: run in autocommit
    (Database.one_statement) it is one round trip, without BEGIN and COMMIT.

    Parameters: the checkpoint's columns prefixed ``c_``, the job's prefixed ``j_``, and
    ``m_names``/``m_values`` (arrays) for the metric values. Returns (checkpoint id, job
    id or None, metric values inserted, run counters moved: 0 after a reservation).
    """
    new_checkpoint = (
        insert(_checkpoints)
        .values({name: bindparam(f"c_{name}") for name in _checkpoint_columns()})
        .returning(_checkpoints.c.id, _checkpoints.c.run_id)
        .cte("new_checkpoint")
    )
    new_values = _new_metric_values(new_checkpoint)
    job_id: Any = literal(None, Integer)
    if with_job:
        job_id = select(_new_job(new_checkpoint).c.id).scalar_subquery()
    # A CTE runs only if the statement refers to it.
    counter_moved = (
        counter_past(bindparam("c_run_id"), bindparam("c_report_index"))
        .returning(_runs.c.id)
        .cte("counter_moved")
    )
    columns = [
        new_checkpoint.c.id,
        job_id,
        select(func.count()).select_from(new_values).scalar_subquery(),
        select(func.count()).select_from(counter_moved).scalar_subquery(),
    ]
    if with_job:
        # The replicas' wake-up (wakeups.py), sent at commit, in the same round trip.
        columns.append(wakeups.NOTIFY.scalar_subquery())
    return select(*columns)


def import_rows(conn: Connection, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
    """Many checkpoints rows of one run (checkpoint_row's, created_at and
    validation_status set) with their metric values, without jobs, in a few statements."""
    ids = conn.execute(_INSERT_CHECKPOINTS_IN_ORDER, rows).scalars().all()
    top = max(row["report_index"] for row in rows)
    conn.execute(_MOVE_COUNTER_PAST, {"b_run_id": run_id, "b_report_index": top})
    values = [
        value
        for checkpoint_id, row in zip(ids, rows, strict=True)
        for value in metric_rows(checkpoint_id, run_id, row["metrics"], MetricSource.REPORTED)
    ]
    if values and conn.dialect.name == "postgresql":
        _copy_metric_values(conn, values)
    elif values:
        conn.execute(_INSERT_METRIC_VALUES, values)


def counter_past(run_id: Any, report_index: Any):
    """The UPDATE that moves the run's report counter past ``report_index``; it matches
    no row (and so locks none) when the counter is past the index already."""
    return (
        update(_runs)
        .where(_runs.c.id == run_id, _runs.c.next_report_index <= report_index)
        .values(next_report_index=report_index + 1)
    )


def _postgresql_parameters(
    row: dict[str, Any], request: ValidationRequest | None
) -> dict[str, Any]:
    ranked = rankable(row["metrics"])
    params = {f"c_{name}": value for name, value in row.items()}
    params["m_names"], params["m_values"] = list(ranked), list(ranked.values())
    if request is not None:
        job_row = transitions.enqueue_row(
            request, 0, row["run_id"], row["report_index"], row["created_at"]
        )
        params.update({f"j_{name}": job_row[name] for name in _job_columns()})
    return params


def _new_metric_values(new_checkpoint):
    """The CTE inserting the new checkpoint's reported metric values from the arrays."""
    metric = (
        func.unnest(
            bindparam("m_names", type_=ARRAY(String)), bindparam("m_values", type_=ARRAY(Float))
        )
        .table_valued("name", "value")
        .render_derived()
    )
    return (
        insert(_values)
        .from_select(
            ["checkpoint_id", "run_id", "name", "source", "value", "effective"],
            select(
                new_checkpoint.c.id,
                new_checkpoint.c.run_id,
                metric.c.name,
                literal(MetricSource.REPORTED.value, String),
                metric.c.value,
                literal(True),
            ).select_from(new_checkpoint.join(metric, true())),
        )
        .returning(_values.c.checkpoint_id)
        .cte("new_values")
    )


def _new_job(new_checkpoint):
    """The CTE inserting the new checkpoint's QUEUED job from the ``j_`` parameters."""
    job_columns = _job_columns()
    return (
        insert(_jobs)
        .from_select(
            ["checkpoint_id", *job_columns],
            select(
                new_checkpoint.c.id,
                *(bindparam(f"j_{name}", type_=_jobs.c[name].type) for name in job_columns),
            ),
        )
        .returning(_jobs.c.id)
        .cte("new_job")
    )


@functools.cache
def _checkpoint_columns() -> tuple[str, ...]:
    return tuple(checkpoint_row(0, 0, None, None, "", 0, None, {}))


@functools.cache
def _job_columns() -> tuple[str, ...]:
    """The job row's columns but checkpoint_id, which the statement takes from its CTE."""
    row = transitions.enqueue_row(ValidationRequest("", "", ""), 0, 0, 0, utcnow())
    return tuple(name for name in row if name != "checkpoint_id")


def _copy_metric_values(conn: Connection, values: list[dict[str, Any]]) -> None:
    """PostgreSQL's COPY for a bulk import's metric values (see raw_sql.py)."""
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        with cursor.copy(raw_sql.COPY_METRIC_VALUES) as copy:
            for value in values:
                copy.write_row([value[name] for name in raw_sql.METRIC_VALUE_COLUMNS])
    finally:
        cursor.close()


# Statements built once, values bound per call (SQLAlchemy then reuses the compiled form
# instead of rebuilding it from .values()): a registration runs once per report.
_INSERT_CHECKPOINT = insert(_checkpoints).returning(_checkpoints.c.id)
_INSERT_CHECKPOINTS_IN_ORDER = insert(_checkpoints).returning(
    _checkpoints.c.id, sort_by_parameter_order=True
)
_INSERT_METRIC_VALUES = insert(_values)
_INSERT_JOB = insert(_jobs).returning(_jobs.c.id)
_MOVE_COUNTER_PAST = counter_past(bindparam("b_run_id"), bindparam("b_report_index"))
