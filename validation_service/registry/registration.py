"""A checkpoint and its validation job, written together: the catalog's rows and the
queue's in one transaction, and on PostgreSQL in one statement."""

from __future__ import annotations

import datetime as dt
import functools
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
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from validation_service.jobs import MetricSource
from validation_service.metrics import rankable
from validation_service.registry import transitions, wakeups
from validation_service.registry.catalog import Catalog, checkpoint_row, counter_past
from validation_service.registry.models import (
    Checkpoint,
    MetricValue,
    Run,
    ValidationJob,
    utcnow,
)
from validation_service.request import ValidationRequest


def insert_checkpoint_and_job(
    conn: Connection,
    catalog: Catalog,
    row: dict[str, Any],
    request: ValidationRequest | None,
    now: dt.datetime,
) -> tuple[int, int | None]:
    """Adds a checkpoints row (catalog.checkpoint_row), its metric values and, with a
    request, its QUEUED job; returns (checkpoint id, job id or None). The run's report
    index counter is moved past the row's index if a reservation did not already."""
    if conn.dialect.name == "postgresql":
        return _register_in_one_statement(conn, row, request)
    checkpoint_id = catalog.insert_checkpoint(conn, row)
    catalog.keep_counter_past(conn, row["run_id"], row["report_index"])
    job_id = None
    if request is not None:
        job_id = transitions.enqueue(
            conn, request, checkpoint_id, row["run_id"], row["report_index"], now
        )
    return checkpoint_id, job_id


def _register_in_one_statement(
    conn: Connection, row: dict[str, Any], request: ValidationRequest | None
) -> tuple[int, int | None]:
    ranked = rankable(row["metrics"])
    params = {f"c_{name}": value for name, value in row.items()}
    params["m_names"], params["m_values"] = list(ranked), list(ranked.values())
    if request is not None:
        job_row = transitions.enqueue_row(
            request, 0, row["run_id"], row["report_index"], row["created_at"]
        )
        params.update({f"j_{name}": job_row[name] for name in _job_columns()})
    checkpoint_id, job_id, *_ = conn.execute(
        _one_statement_registration(request is not None), params
    ).one()
    return checkpoint_id, job_id


@functools.cache
def _one_statement_registration(with_job: bool):
    """PostgreSQL: a checkpoint, its metric values and its job in one statement (one
    round trip instead of three), chained by data-modifying CTEs.

    Parameters: the checkpoint's columns prefixed ``c_``, the job's prefixed ``j_``, and
    ``m_names``/``m_values`` (arrays) for the metric values. Returns (checkpoint id, job
    id or None, metric values inserted, run counters moved: 0 after a reservation).
    """
    checkpoints = Checkpoint.__table__
    new_checkpoint = (
        insert(checkpoints)
        .values({name: bindparam(f"c_{name}") for name in _checkpoint_columns()})
        .returning(checkpoints.c.id, checkpoints.c.run_id)
        .cte("new_checkpoint")
    )
    new_values = _new_metric_values(new_checkpoint)
    job_id: Any = literal(None, Integer)
    if with_job:
        job_id = select(_new_job(new_checkpoint).c.id).scalar_subquery()
    # A CTE runs only if the statement refers to it.
    counter_moved = (
        counter_past(bindparam("c_run_id"), bindparam("c_report_index"))
        .returning(Run.__table__.c.id)
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


def _new_metric_values(new_checkpoint):
    """The CTE inserting the new checkpoint's reported metric values from the arrays."""
    values = MetricValue.__table__
    metric = (
        func.unnest(
            bindparam("m_names", type_=ARRAY(String)), bindparam("m_values", type_=ARRAY(Float))
        )
        .table_valued("name", "value")
        .render_derived()
    )
    return (
        insert(values)
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
        .returning(values.c.checkpoint_id)
        .cte("new_values")
    )


def _new_job(new_checkpoint):
    """The CTE inserting the new checkpoint's QUEUED job from the ``j_`` parameters."""
    jobs = ValidationJob.__table__
    job_columns = _job_columns()
    return (
        insert(jobs)
        .from_select(
            ["checkpoint_id", *job_columns],
            select(
                new_checkpoint.c.id,
                *(bindparam(f"j_{name}", type_=jobs.c[name].type) for name in job_columns),
            ),
        )
        .returning(jobs.c.id)
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
