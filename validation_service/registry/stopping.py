"""Early stopping in the registry: stop policies stored by run name, the decision taken
after a validation's result is merged (the rules themselves are in
validation_service/stopping.py, without a database), and a user's override.

``judge`` (``StopRules.evaluate``, ``Housekeeping.after_validation``) judges; the users'
calls (Registry.set_stop_policy, stop_policy, stop_decision, resume_despite_stop) run
the statements below in their own transaction.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput
from validation_service.jobs import MetricSource
from validation_service.registry.aliases import put_or_remove
from validation_service.registry.catalog import check_run_name
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.models import (
    Checkpoint,
    MetricValue,
    Run,
    StopDecisionRow,
    StopPolicyRow,
    utcnow,
)
from validation_service.registry.records import StopDecision
from validation_service.stopping import Observation, PeerCurves, StopPolicy, Verdict, decide

logger = logging.getLogger(__name__)

# The policy's fields, stored under the same names.
_POLICY_COLUMNS = (
    "metric",
    "mode",
    "patience",
    "min_delta",
    "threshold",
    "divergence",
    "median_of_runs",
    "warmup",
)


_POLICY_FIELDS = tuple(StopPolicyRow.__table__.c[name] for name in _POLICY_COLUMNS)


class StopRules:
    """Judges a run attempt by its name's stop policy after a validation ended
    (``Housekeeping.judge_stop_policy``), for the runs of any namespace of the database.
    The users' side (storing a policy, reading a decision, the override) is the
    Registry's, over the statements below."""

    def __init__(self, db: Database):
        self.db = db

    @retry_on_disconnect
    def evaluate(self, run_id: int) -> StopDecision | None:
        """Judges the run attempt by its name's policy (see judge), in one transaction."""
        with self.db.write() as conn:
            return judge(conn, run_id)


def judge(conn: Connection, run_id: int) -> StopDecision | None:
    """Judges the run attempt by its name's policy, after a validation's result was
    merged (or failed) or a policy was stored, in the caller's write transaction; stores
    and returns a new decision, or None. The first decision of a round stays (a unique
    key), however many validations finish at once."""
    found = _policy_and_run(conn, run_id)
    if found is None:
        return None
    policy, run = found
    latest = conn.execute(_decisions_query().where(Run.id == run_id)).all()
    if latest and latest[-1].overridden_at is None:
        return None  # decided: later results are merged, the decision stays
    after = latest[-1].resumed_after_index if latest else None
    seen = _observations(conn, run_id, policy.metric, after)
    peers = _peers(conn, run, policy.metric) if policy.median_of_runs else None
    verdict = decide(policy, seen, peers)
    if verdict is None:
        return None
    round_ = latest[-1].round + 1 if latest else 0
    if not _insert_decision(conn, run_id, round_, policy, verdict):
        return None
    if verdict.skipped:
        logger.info(
            "run %r: passed over checkpoints %s before deciding",
            run.name,
            ", ".join(f"{index} ({why})" for index, why in verdict.skipped),
        )
    logger.info("run %r should stop: %s", run.name, verdict.reason)
    return latest_decision(conn, run_id)


def check_policy(run: str, policy: StopPolicy | None) -> None:
    check_run_name(run)
    if policy is not None and not isinstance(policy, StopPolicy):
        raise InvalidInput(
            f"set_stop_policy needs a validation_service.StopPolicy (or None to remove "
            f"the run's policy), got {type(policy).__name__}"
        )


def store_policy(conn: Connection, namespace: str, run: str, policy: StopPolicy | None) -> None:
    """Stores (None: removes) the run name's policy."""
    values = None
    if policy is not None:
        values = {name: getattr(policy, name) for name in _POLICY_COLUMNS}
        values["updated_at"] = utcnow()
    keys = {"namespace": namespace, "run_name": run}
    put_or_remove(conn, StopPolicyRow.__table__, keys, values)


def stored_policy(session: Session, namespace: str, run: str) -> StopPolicy | None:
    """The run name's stored policy, or None."""
    row = session.scalar(
        select(StopPolicyRow).where(
            StopPolicyRow.namespace == namespace, StopPolicyRow.run_name == run
        )
    )
    return None if row is None else _policy(row)


def latest_decisions(session: Session, namespace: str) -> dict[int, StopDecision]:
    """Run id -> its latest decision, for every run of the namespace that has one."""
    rows = session.execute(decisions_query(namespace)).all()
    return {row.run_id: _decision(row) for row in rows}


def override(conn: Connection, run: str, run_id: int) -> StopDecision:
    """Overrides the standing decision of the run attempt (the judging starts again after
    its last report); InvalidInput when it has none."""
    latest = conn.execute(_decisions_query().where(Run.id == run_id)).all()
    if not latest or latest[-1].overridden_at is not None:
        raise InvalidInput(
            f"run {run!r} is not stopped: no stop decision to override "
            f"(`ckval run {run}` shows its decision)"
        )
    resumed_after = _last_report_index(conn, run_id)
    changed = conn.execute(
        update(StopDecisionRow)
        .where(StopDecisionRow.id == latest[-1].id, StopDecisionRow.overridden_at.is_(None))
        .values(overridden_at=utcnow(), resumed_after_index=resumed_after)
    )
    if changed.rowcount != 1:  # another override came first
        raise InvalidInput(f"run {run!r} is not stopped: it was resumed meanwhile")
    decision = latest_decision(conn, run_id)
    assert decision is not None
    return decision


def decisions_query(namespace: str):
    """Every stop decision of the namespace's runs, by run id and round: the last of a
    run is its latest (the CLI's fast read runs it too)."""
    return _decisions_query().where(Run.namespace == namespace)


def _decisions_query():
    return (
        select(
            *StopDecisionRow.__table__.c,
            Run.name.label("run_name"),
            Run.attempt.label("run_attempt"),
        )
        .join(Run, Run.id == StopDecisionRow.run_id)
        .order_by(StopDecisionRow.run_id, StopDecisionRow.round)
    )


def latest_decision(session: Session | Connection, run_id: int) -> StopDecision | None:
    """The last round's decision of the run attempt, or None."""
    rows = session.execute(_decisions_query().where(Run.id == run_id)).all()
    return _decision(rows[-1]) if rows else None


def _decision(row: Any) -> StopDecision:
    return StopDecision.from_row(row, row.run_name, row.run_attempt)


def _policy(row: Any) -> StopPolicy:
    """The policy of a stop_policies row (an ORM row or a plain one with its columns)."""
    return StopPolicy(**{name: getattr(row, name) for name in _POLICY_COLUMNS})


def _policy_and_run(session: Session | Connection, run_id: int) -> tuple[StopPolicy, Any] | None:
    """The policy stored for the run attempt's name, and the attempt; None without one."""
    found = session.execute(
        select(*_POLICY_FIELDS, Run.id, Run.name, Run.namespace)
        .join(
            Run,
            and_(Run.namespace == StopPolicyRow.namespace, Run.name == StopPolicyRow.run_name),
        )
        .where(Run.id == run_id)
    ).first()
    if found is None:
        return None
    return _policy(found), found


def _observations(
    session: Session | Connection, run_id: int, metric: str, after_index: int | None
) -> list[Observation]:
    """The run attempt's checkpoints (after ``after_index``) as the rules see them."""
    query = select(
        Checkpoint.report_index,
        Checkpoint.step,
        Checkpoint.validation_status,
        Checkpoint.validated_metrics,
    ).where(Checkpoint.run_id == run_id)
    if after_index is not None:
        query = query.where(Checkpoint.report_index > after_index)
    return [
        Observation(row.report_index, row.step, row.validation_status, _number(row, metric))
        for row in session.execute(query.order_by(Checkpoint.report_index))
    ]


def _number(row: Any, metric: str) -> float | None:
    """The checkpoint's validated value of ``metric`` (NaN and infinities included), or
    None when its validated metrics have no number of that name."""
    value = (row.validated_metrics or {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _peers(session: Session | Connection, run: Any, metric: str) -> PeerCurves:
    """The validated values of ``metric`` of the namespace's earlier run attempts (smaller
    ids), by step (else report index). Only finite values are ranked, so only they count."""
    position = func.coalesce(Checkpoint.step, Checkpoint.report_index)
    rows = session.execute(
        select(MetricValue.run_id, position, MetricValue.value)
        .join(Checkpoint, Checkpoint.id == MetricValue.checkpoint_id)
        .join(Run, Run.id == MetricValue.run_id)
        .where(
            MetricValue.name == metric,
            MetricValue.source == MetricSource.VALIDATED.value,
            Run.namespace == run.namespace,
            MetricValue.run_id < run.id,
        )
        .order_by(MetricValue.run_id, Checkpoint.report_index)
    )
    curves: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for run_id, at, value in rows:
        curves[run_id].append((int(at), float(value)))
    return PeerCurves(curves)


def _insert_decision(
    conn: Connection, run_id: int, round_: int, policy: StopPolicy, verdict: Verdict
) -> bool:
    """INSERT ... ON CONFLICT (run_id, round) DO NOTHING: False when another finisher
    decided this round first."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(StopDecisionRow).values(
        run_id=run_id,
        round=round_,
        rule=verdict.rule,
        report_index=verdict.report_index,
        reason=verdict.reason,
        policy=policy.to_dict(),
        metric_values=[list(pair) for pair in verdict.values],
        reference=verdict.reference,
        skipped=[list(pair) for pair in verdict.skipped],
        decided_at=utcnow(),
    )
    result = conn.execute(statement.on_conflict_do_nothing(index_elements=["run_id", "round"]))
    return result.rowcount == 1


def _last_report_index(conn: Connection, run_id: int) -> int:
    """The highest report index the run attempt reserved or registered (-1: none)."""
    reserved = conn.scalar(select(Run.next_report_index).where(Run.id == run_id)) or 0
    registered = conn.scalar(
        select(func.max(Checkpoint.report_index)).where(Checkpoint.run_id == run_id)
    )
    return max(reserved - 1, -1 if registered is None else registered)
