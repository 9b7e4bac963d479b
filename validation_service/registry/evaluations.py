"""Named evaluations over stored checkpoints.

A checkpoint's first validation is the one its report() asked for: the "default"
validator, whose metrics merge into the checkpoint's own (catalog.merge_validated).
``revalidate`` queues another evaluation, under a name of its own, over checkpoints
already stored; its results stay apart, one evaluation_metrics row per (checkpoint,
validator, metric), and are ranked on their own (``best``); they never feed the merge,
aliases, stop policies or retention, so "default" is never the name of one. A folder
made outside training joins a run through registry/outside_folders.py.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Row
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput, UnknownMetric
from validation_service.jobs import (
    ACTIVE_JOB_STATUSES,
    DEFAULT_VALIDATOR,
    JobStatus,
)
from validation_service.metrics import rankable
from validation_service.names import check_name
from validation_service.registry import aliases, transitions
from validation_service.registry.catalog import RECORD_COLUMNS, Ranking, checkpoint_record
from validation_service.registry.evaluation_caps import RevalidationCaps
from validation_service.registry.limits import IDS_PER_IN_LIST
from validation_service.registry.models import (
    Checkpoint,
    EvaluationMetric,
    Run,
    ValidationJob,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord, with_evaluations
from validation_service.registry.wakeups import wake_replicas
from validation_service.request import ValidationRequest
from validation_service.signing import PayloadTrust, job_binding
from validation_service.validation import (
    check_evaluation_name,
    check_flag,
    check_report_index,
)

_jobs, _checkpoints, _values = (
    ValidationJob.__table__,
    Checkpoint.__table__,
    EvaluationMetric.__table__,
)
# A checkpoint with a job of the validator in one of these is not queued again (force
# queues it anyway); after FAILED, TIMED_OUT or CANCELLED, revalidate tries again.
HAS_EVALUATION = (*ACTIVE_JOB_STATUSES, JobStatus.SUCCEEDED)


@dataclasses.dataclass(frozen=True)
class Revalidation:
    """What one revalidate() did: the jobs it queued, and the checkpoints it passed over
    as (run, report index): those with a job of the validator already, deleted ones, and
    (with caps) those whose jobs of the validator used up their budget."""

    job_ids: list[int]
    already: list[tuple[str, int]]
    deleted: list[tuple[str, int]]
    over_budget: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Target:
    """A stored checkpoint an evaluation may be queued for."""

    checkpoint_id: int
    run_id: int
    run: str
    report_index: int
    uri: str
    deleted: bool


def targets(
    session: Session,
    namespace: str,
    run_ids: Sequence[int],
    checkpoint_ids: Sequence[int] | None,
) -> list[Target]:
    """The checkpoints of these run attempts (or exactly ``checkpoint_ids``) in the
    namespace, in report order."""
    query = select(
        _checkpoints.c.id,
        _checkpoints.c.run_id,
        Run.name,
        _checkpoints.c.report_index,
        _checkpoints.c.uri,
        _checkpoints.c.deleted_at,
    ).join(Run, Run.id == _checkpoints.c.run_id)
    query = query.where(Run.namespace == namespace)
    if checkpoint_ids is not None:
        query = query.where(_checkpoints.c.id.in_(list(checkpoint_ids)))
    else:
        query = query.where(_checkpoints.c.run_id.in_(list(run_ids)))
    rows = session.execute(query.order_by(_checkpoints.c.run_id, _checkpoints.c.report_index))
    return [Target(r[0], r[1], r[2], r[3], r[4], r[5] is not None) for r in rows]


def only_reports(found: list[Target], reports: Sequence[int], runs: Sequence[str]) -> list[Target]:
    """The targets at these report indices; InvalidInput naming an index a run lacks."""
    wanted = set(reports)
    for run in runs:
        have = {t.report_index for t in found if t.run == run}
        missing = sorted(wanted - have)
        if missing:
            raise InvalidInput(
                f"run {run!r} has no checkpoint at report index {missing}; "
                f"`ckval checkpoints {run}` lists its report indices"
            )
    return [t for t in found if t.report_index in wanted]


def evaluated_ids(conn: Connection, validator: str, found: list[Target]) -> set[int]:
    """The checkpoints among ``found`` with a QUEUED, RUNNING or SUCCEEDED job of
    ``validator``."""
    statuses = [s.value for s in HAS_EVALUATION]
    query = select(_jobs.c.checkpoint_id).where(
        _jobs.c.validator == validator, _jobs.c.status.in_(statuses)
    )
    run_ids = sorted({t.run_id for t in found})
    query = query.where(_jobs.c.run_id.in_(run_ids))
    wanted = {t.checkpoint_id for t in found}
    return {checkpoint_id for checkpoint_id in conn.execute(query).scalars()} & wanted


def queue_jobs(
    conn: Connection,
    namespace: str,
    request: ValidationRequest,
    trust: PayloadTrust,
    found: list[Target],
) -> list[int]:
    """Adds one QUEUED job of ``request`` per target (each signed for its own checkpoint,
    as a report's is) in one statement; returns their ids in target order."""
    from validation_service.payloads import signed_request

    now = utcnow()
    batch = secrets.token_hex(6)
    rows = []
    for target in found:
        job_key = (
            f"run:{target.run_id}/report:{target.report_index}/"
            f"validator:{request.validator}/{batch}"
        )
        bound_to = job_binding(
            namespace,
            target.run,
            target.report_index,
            target.uri,
            validator=request.validator,
            job_key=job_key,
        )
        signed = signed_request(request, trust, bound_to=bound_to)
        row = transitions.enqueue_row(
            signed, target.checkpoint_id, target.run_id, target.report_index, now
        )
        row["idempotency_key"] = job_key
        rows.append(row)
    if not rows:
        return []
    if conn.dialect.name == "postgresql":
        ids = _insert_unnested(conn, rows)
    else:
        statement = insert(_jobs).returning(_jobs.c.id, sort_by_parameter_order=True)
        ids = list(conn.execute(statement, rows).scalars())
    wake_replicas(conn)
    return ids


# The columns that differ from one revalidation job to the next; the others are the
# request's, the same for every job of one revalidate().
_PER_JOB = ("checkpoint_id", "run_id", "idempotency_key", "validate_fn_pickle", "validate_config")


def _insert_unnested(conn: Connection, rows: list[dict[str, Any]]) -> list[int]:
    """PostgreSQL: every job in one INSERT ... SELECT FROM unnest(arrays): the per-job
    columns travel as five arrays and the others once, so that 10,000 jobs cost one
    statement of a fixed size (no per-row placeholders to expand). Ids in row order."""
    shared = [name for name in rows[0] if name not in _PER_JOB]
    arrays = (
        func.unnest(
            *(
                bindparam(f"a_{name}", [row[name] for row in rows], type_=ARRAY(_jobs.c[name].type))
                for name in _PER_JOB
            )
        )
        .table_valued(*_PER_JOB)
        .render_derived()
    )
    constants = [
        bindparam(f"c_{name}", rows[0][name], type_=_jobs.c[name].type).label(name)
        for name in shared
    ]
    source = select(*(arrays.c[name] for name in _PER_JOB), *constants)
    statement = (
        insert(_jobs)
        .from_select([*_PER_JOB, *shared], source)
        .returning(_jobs.c.id, _jobs.c.checkpoint_id)
    )
    by_checkpoint = dict((c, i) for i, c in conn.execute(statement).all())
    return [by_checkpoint[row["checkpoint_id"]] for row in rows]


def store_results(conn: Connection, job: Row, metrics: dict[str, Any]) -> None:
    """A named evaluation's results, in place of that validator's earlier ones for the
    checkpoint (the checkpoint's own metrics, report()'s, stay as they are)."""
    conn.execute(
        delete(_values).where(
            _values.c.checkpoint_id == job.checkpoint_id, _values.c.validator == job.validator
        )
    )
    if job.deleted_at is not None:
        return  # deleted while it was evaluated: never ranked
    rows = [
        {
            "checkpoint_id": job.checkpoint_id,
            "validator": job.validator,
            "name": name,
            "run_id": job.run_id,
            "value": value,
        }
        for name, value in rankable(metrics).items()
    ]
    if rows:
        conn.execute(insert(_values), rows)


def evaluations_query(checkpoint_ids: Any):
    """(checkpoint id, validator, metrics) of the named evaluations' SUCCEEDED jobs of
    these checkpoints, oldest first (the CLI's fast read runs it too)."""
    return (
        select(_jobs.c.checkpoint_id, _jobs.c.validator, _jobs.c.result_metrics)
        .where(
            _jobs.c.checkpoint_id.in_(checkpoint_ids),
            _jobs.c.validator != DEFAULT_VALIDATOR,
            _jobs.c.status == JobStatus.SUCCEEDED.value,
        )
        .order_by(_jobs.c.id)
    )


def labelled(session: Session, records: list[CheckpointRecord]) -> list[CheckpointRecord]:
    """The records with their aliases, tags and every validator's metrics, as
    Registry.checkpoints and the run page return them."""
    return by_validator(session, aliases.with_aliases_and_tags(session, records))


def by_validator(session: Session, records: list[CheckpointRecord]) -> list[CheckpointRecord]:
    """The records with ``evaluations`` filled: validator -> its metrics, "default" being
    the validated metrics of report()'s own validation, the others each validator's
    latest SUCCEEDED job."""
    found: dict[int, dict[str, dict[str, Any]]] = {}
    ids = [record.id for record in records]
    for start in range(0, len(ids), IDS_PER_IN_LIST):
        query = evaluations_query(ids[start : start + IDS_PER_IN_LIST])
        for checkpoint_id, validator, metrics in session.execute(query):
            found.setdefault(checkpoint_id, {})[validator] = metrics or {}
    return [with_evaluations(record, found.get(record.id, {})) for record in records]


def best(
    session: Session, namespace: str, run_id: int | None, ranking: Ranking
) -> list[CheckpointRecord]:
    """Top-k live checkpoints by one named evaluation's values of a metric; ties: the
    earlier report. ``run_id``: one run attempt, None: every run of the namespace."""
    validator, metric, mode, k = ranking.validator, ranking.metric, ranking.mode, ranking.k
    order = _values.c.value.desc() if mode == "max" else _values.c.value.asc()
    query = (
        select(*RECORD_COLUMNS, Run.name.label("run_name"))
        .join(_values, _values.c.checkpoint_id == _checkpoints.c.id)
        .join(Run, Run.id == _values.c.run_id)
        .where(
            _values.c.validator == validator,
            _values.c.name == metric,
            Run.namespace == namespace,
            _checkpoints.c.deleted_at.is_(None),
        )
    )
    if run_id is not None:
        query = query.where(_values.c.run_id == run_id)
    rows = session.execute(query.order_by(order, _values.c.checkpoint_id).limit(k)).all()
    return [checkpoint_record(row, row.run_name) for row in rows]


def known_metrics(session: Session, run_id: int | None, validator: str) -> set[str]:
    query = select(_values.c.name).where(_values.c.validator == validator).distinct()
    if run_id is not None:
        query = query.where(_values.c.run_id == run_id)
    return set(session.execute(query).scalars())


def active_jobs(session: Session, run_id: int | None, validator: str) -> int:
    statuses = sorted(status.value for status in ACTIVE_JOB_STATUSES)
    query = select(_jobs.c.id).where(_jobs.c.validator == validator, _jobs.c.status.in_(statuses))
    if run_id is not None:
        query = query.where(_jobs.c.run_id == run_id)
    return len(session.execute(query.limit(1)).all())


def evaluation_request(
    validate_fn: Any,
    validate_config: dict | None,
    validation_resources: dict | None,
    validator: str,
    priority: int,
    *,
    background: bool = True,
) -> ValidationRequest:
    """The request of a revalidation: a background job of ``validator``, never named
    "default" (a watched folder's: a live one, which may be the folders' "default"
    validation, as a report's). A validator with a job_payload (CommandValidator) is
    stored as its reference and settings, no pickle."""
    from validation_service.payloads import validation_request
    from validation_service.validate_fn import takes_config_as_keywords

    if background:
        check_evaluation_name(validator)
    else:
        check_name("validator name", validator)
    timeout_s = None
    if hasattr(validate_fn, "job_payload"):
        if validate_config:
            raise InvalidInput(
                f"{validate_fn!r} takes no validate_config: its argv, env and timeout_s are "
                "its settings."
            )
        resources = validation_resources or validate_fn.recommended_resources
        timeout_s = validate_fn.job_timeout_s
        validate_fn, validate_config = validate_fn.job_payload()
        validation_resources = resources
    elif callable(validate_fn):
        takes_config_as_keywords(validate_fn, validate_config or {})
    return validation_request(
        validate_fn,
        validate_config,
        validation_resources,
        priority=priority,
        timeout_s=timeout_s,
        max_attempts=3,
        validator=validator,
        background=background,
    )


def revalidate(
    registry,
    run_or_runs: Any,
    request: ValidationRequest,
    *,
    reports: Sequence[int] | None,
    force: bool,
    caps: RevalidationCaps | None = None,
) -> Revalidation:
    """Queues ``request`` for the stored checkpoints of one run, a list of runs, or a
    search() result (only ``reports``, when given), in one write transaction. See
    Registry.revalidate. ``caps``: the bounds of the HTTP API (evaluation_caps.py),
    checked before anything is queued."""
    check_flag("force", force)
    check_evaluation_name(request.validator)
    if caps is not None:
        caps.check_request(request)
    runs, checkpoint_ids = _named_targets(run_or_runs)
    if reports is not None:
        reports = [check_report_index(index) for index in reports]
    trust = PayloadTrust.from_settings(registry.settings)
    with registry.db.write() as conn:
        run_ids = [registry.catalog.require_run_id(conn, run) for run in runs]
        found = targets(conn, registry.namespace, run_ids, checkpoint_ids)
        if reports is not None:
            found = only_reports(found, reports, runs or sorted({t.run for t in found}))
        live = [t for t in found if not t.deleted]
        done = set() if force else evaluated_ids(conn, request.validator, live)
        todo = [t for t in live if t.checkpoint_id not in done]
        spent: set[int] = set()
        if caps is not None:
            spent = caps.spent_ids(conn, request.validator, todo)
            todo = [t for t in todo if t.checkpoint_id not in spent]
            caps.check_room(conn, registry.namespace, len(todo))
        job_ids = queue_jobs(conn, registry.namespace, request, trust, todo)
    return Revalidation(
        job_ids,
        already=[(t.run, t.report_index) for t in live if t.checkpoint_id in done],
        deleted=[(t.run, t.report_index) for t in found if t.deleted],
        over_budget=[(t.run, t.report_index) for t in live if t.checkpoint_id in spent],
    )


def _named_targets(run_or_runs: Any) -> tuple[list[str], list[int] | None]:
    """(run names, None) for a run or runs; ([], checkpoint ids) for search() records."""
    if isinstance(run_or_runs, str):
        return [check_name("run name", run_or_runs)], None
    items = list(run_or_runs) if isinstance(run_or_runs, (list, tuple)) else None
    if items and all(isinstance(item, CheckpointRecord) for item in items):
        return [], [item.id for item in items]
    if items and all(isinstance(item, str) for item in items):
        return [check_name("run name", item) for item in dict.fromkeys(items)], None
    raise InvalidInput(
        "revalidate takes a run name, a list of run names, or the checkpoints a search() "
        f"returned, got {run_or_runs!r}"
    )


def best_records(session: Session, catalog, run, attempt, ranking: Ranking):
    """Registry.best_checkpoint(_record)s by a named evaluation's values, in the caller's
    read (``catalog``: the Registry's, of its namespace)."""
    validator, metric = ranking.validator, ranking.metric
    check_name("validator name", validator)
    if ranking.tags:
        raise InvalidInput("tags= filters the default validator's ranking only")
    if ranking.mode not in ("max", "min"):
        raise InvalidInput(f"mode must be 'max' or 'min', got {ranking.mode!r}")
    run_id = None if run is None else catalog.require_run_id(session, run, attempt)
    found = best(session, catalog.namespace, run_id, ranking)
    if found:
        return by_validator(session, found)
    known = known_metrics(session, run_id, validator)
    if metric in known or active_jobs(session, run_id, validator):
        return []
    raise UnknownMetric(metric, run, sorted(known), validator=validator)
