"""Plain, typed records the Registry returns (no ORM objects leave the registry).

The records read off a row of many columns are built by keyword only: a field added
or moved never shifts another's value.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

from validation_service.jobs import DEFAULT_VALIDATOR
from validation_service.stopping import StopPolicy


@dataclasses.dataclass(frozen=True)
class RunRecord:
    id: int
    name: str
    namespace: str
    storage_root: str
    created_at: dt.datetime
    status: str
    tags: dict[str, Any]
    # A run name reused after the run ended starts attempt 2, 3, ...: each its own row.
    attempt: int = 1
    ended_at: dt.datetime | None = None


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """Why the service decided that a run attempt should stop (registry/stopping.py).

    ``rule``: "patience", "threshold", "divergence" or "median_of_runs"; ``report_index``:
    the checkpoint whose validated value decided; ``values``: the (report index, value)
    pairs the rule looked at, in report order; ``reference``: what they were compared
    with (the best value, the target or the median); ``skipped``: (report index, why) of
    the checkpoints passed over on the way (a validation FAILED, TIMED_OUT or CANCELLED,
    or no value of the metric); ``policy``: the policy as it was when it decided.

    A user's override (``Registry.resume_despite_stop``) sets ``overridden_at``: the run is
    no longer stopped, and the rules may decide again (``round`` + 1) on the checkpoints
    reported after ``resumed_after_index``.
    """

    run: str
    attempt: int
    rule: str
    reason: str
    report_index: int
    values: tuple[tuple[int, float], ...]
    reference: float | None
    skipped: tuple[tuple[int, str], ...]
    policy: StopPolicy
    decided_at: dt.datetime
    round: int = 0
    overridden_at: dt.datetime | None = None
    resumed_after_index: int | None = None

    @property
    def stopped(self) -> bool:
        """True while the decision stands (no override)."""
        return self.overridden_at is None

    @classmethod
    def from_row(cls, row: Any, run: str, attempt: int) -> StopDecision:
        """The record of a stop_decisions row (its JSON columns decoded)."""
        return cls(
            run=run,
            attempt=attempt,
            rule=row.rule,
            reason=row.reason,
            report_index=row.report_index,
            values=tuple((int(i), float(v)) for i, v in row.metric_values),
            reference=row.reference,
            skipped=tuple((int(i), str(why)) for i, why in row.skipped),
            policy=StopPolicy.from_mapping(row.policy),
            decided_at=row.decided_at,
            round=row.round,
            overridden_at=row.overridden_at,
            resumed_after_index=row.resumed_after_index,
        )


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """A run with how many checkpoints it has, how many of its jobs are in each status, and
    its latest stop decision (None when no stop policy decided)."""

    run: RunRecord
    checkpoints: int
    job_counts: dict[str, int]
    stop: StopDecision | None = None
    # What its validations held, in accelerator-seconds.
    cost: ValidationCost = dataclasses.field(default_factory=lambda: ValidationCost())


def run_summaries(
    runs: list[RunRecord],
    checkpoints: dict[int, int],
    jobs: dict[int, dict[str, int]],
    stops: dict[int, StopDecision],
    costs: dict[int, ValidationCost],
) -> list[RunSummary]:
    """A RunSummary of each run, from the figures read per run id (the Registry's and the
    CLI's fast read alike)."""
    return [
        RunSummary(
            run,
            checkpoints.get(run.id, 0),
            jobs.get(run.id, {}),
            stops.get(run.id),
            costs.get(run.id) or ValidationCost(),
        )
        for run in runs
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """One reported (or registered) checkpoint: where it is stored, its reported,
    validated and merged metrics (``metrics``: a validated value overrides a reported one
    of the same name), and the status of its default validation."""

    id: int
    run: str
    report_index: int
    step: int | None
    epoch: int | None
    uri: str
    size_bytes: int
    manifest_sha256: str | None
    created_at: dt.datetime
    reported_metrics: dict[str, Any]
    validated_metrics: dict[str, Any] | None
    metrics: dict[str, Any]
    validation_status: str
    deleted_at: dt.datetime | None
    # Filled in by the Registry's *_records methods (the plain best_checkpoints skips them).
    aliases: tuple[str, ...] = ()
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    # Validator name -> its metrics ("default": validated_metrics), where asked for.
    evaluations: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def with_evaluations(
    record: CheckpointRecord, named: dict[str, dict[str, Any]]
) -> CheckpointRecord:
    """The record with ``evaluations``: "default" (its validated metrics, when validated)
    and each named validator's metrics (``named``), in name order."""
    evaluations = {}
    if record.validated_metrics is not None:
        evaluations["default"] = record.validated_metrics
    evaluations.update(sorted(named.items()))
    return dataclasses.replace(record, evaluations=evaluations)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttemptRecord:
    attempt: int
    lease_token: int
    lease_owner: str
    status: str
    claimed_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    node_id: str | None
    worker_pid: int | None
    error_message: str | None
    # What the attempt printed, when its validator kept it (a CommandValidator's program).
    log: str | None = None
    # What it held while it ran: its node's accelerator type, how many accelerators, and
    # for how long (None where nobody saw it run: a lost service, an attempt never started).
    accelerator_type: str | None = None
    accelerators: float | None = None
    running_s: float | None = None

    @property
    def accelerator_s(self) -> float | None:
        """Accelerator-seconds the attempt held: accelerators x running time."""
        if self.running_s is None:
            return None
        return (self.accelerators or 0.0) * self.running_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobRecord:
    """One validation job of a checkpoint and its attempts so far (``ckval job N``)."""

    id: int
    run: str
    checkpoint_id: int
    report_index: int
    status: str
    attempts: int
    max_attempts: int
    priority: int
    pool: str
    resources: dict[str, Any]
    executor_kind: str
    validate_fn_name: str
    not_before: dt.datetime
    lease_owner: str | None
    lease_token: int
    lease_expires_at: dt.datetime | None
    timeout_s: float | None
    error_type: str | None
    error_message: str | None
    error_traceback: str | None
    result_metrics: dict[str, Any] | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    attempt_history: tuple[AttemptRecord, ...] = ()
    # The evaluation the job belongs to: "default" is report()'s own.
    validator: str = "default"
    # What went otherwise than asked though the job ran, newest last (a sink that logged
    # to its own tracker run instead of the one the run recorded): the warnings column.
    warnings: tuple[str, ...] = ()
    # While WAITING_FOR_RESOURCES: since when, and what for ({"resources": the Ray
    # resources its task asks for, "fits": the nodes or node types that can serve it,
    # "note": why it waits}).
    waiting_since: dt.datetime | None = None
    waiting_for: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # The column is a JSON list, or NULL for a job with none.
        object.__setattr__(self, "warnings", tuple(self.warnings or ()))


_R = TypeVar("_R")


def record_from(cls: type[_R], row: Any, **given: Any) -> _R:
    """A record of type ``cls`` with ``given`` fields, the others read off ``row``."""
    names, read = _reader(cls, tuple(given))
    values = dict(zip(names, read(row), strict=True))
    values.update(given)
    return cls(**values)


@functools.cache
def _reader(cls: type, given: tuple[str, ...]) -> tuple[tuple[str, ...], Callable[[Any], tuple]]:
    """The fields of ``cls`` not given, and one getter of them all (built once per call site)."""
    names = tuple(f.name for f in dataclasses.fields(cls) if f.name not in given)
    getter = operator.attrgetter(*names)
    return names, getter if len(names) > 1 else (lambda row: (getter(row),))


@dataclasses.dataclass(frozen=True)
class Registration:
    run_id: int
    checkpoint_id: int
    job_id: int | None
    created: bool  # False when the same run + report index was registered before


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClaimedJob:
    """Everything an executor needs to run one attempt, and the token that fences it."""

    job_id: int
    lease_token: int
    attempt: int
    max_attempts: int
    run: str
    namespace: str
    checkpoint_id: int
    report_index: int
    uri: str
    storage_root: str
    manifest_sha256: str | None
    reported_metrics: dict[str, Any]
    validate_fn_ref: str | None
    validate_fn_pickle: bytes | None
    validate_config: bytes | None
    executor_kind: str
    resources: dict[str, Any]
    pool: str
    timeout_s: float | None
    lease_expires_at: dt.datetime
    # The attempt budget: attempts made before the last `retry`, and whether a timed-out
    # attempt may run again (what the retry policy decides from).
    attempts_before_retry: int = 0
    retry_on_timeout: bool = False
    # The evaluation the job belongs to and its key: a named evaluation's payloads are
    # signed for both (signing.job_binding).
    validator: str = DEFAULT_VALIDATOR
    idempotency_key: str | None = None


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """What one attempt produced, as the executor reports it."""

    succeeded: bool
    metrics: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    retryable: bool = True
    timed_out: bool = False
    node_id: str | None = None
    worker_pid: int | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    # What the attempt printed, when it kept it (a CommandValidator's program output).
    log: str | None = None
    # What it held while it ran (see AttemptRecord).
    accelerator_type: str | None = None
    accelerators: float | None = None


@dataclasses.dataclass(frozen=True)
class CostLine:
    """The accelerator time of one group of attempts: one validator's, in one pool, on
    one accelerator type (None: no accelerator, or an unknown type)."""

    validator: str
    pool: str
    accelerator_type: str | None
    attempts: int  # attempts whose running time is known
    running_s: float
    accelerator_s: float


@dataclasses.dataclass(frozen=True)
class ValidationCost:
    """What validations held, in accelerator-seconds (accelerators x running time of each
    attempt, retries included), by validator, pool and accelerator type."""

    lines: tuple[CostLine, ...] = ()

    @property
    def accelerator_s(self) -> float:
        return sum(line.accelerator_s for line in self.lines)

    @property
    def running_s(self) -> float:
        return sum(line.running_s for line in self.lines)

    def by(self, key: str) -> dict[str, float]:
        """Accelerator-seconds by "validator", "pool" or "accelerator_type" (an attempt
        without an accelerator type counts under "none")."""
        totals: dict[str, float] = {}
        for line in self.lines:
            name = getattr(line, key) or "none"
            totals[name] = totals.get(name, 0.0) + line.accelerator_s
        return dict(sorted(totals.items()))

    @classmethod
    def of_rows(cls, rows: Any) -> ValidationCost:
        """From rows of (validator, pool, accelerator_type, attempts, running_s,
        accelerator_s), as the registry's cost statements group them."""
        lines = [
            CostLine(validator, pool, kind, int(n), float(running or 0), float(accel or 0))
            for validator, pool, kind, n, running, accel in rows
        ]
        return cls(tuple(sorted(lines, key=_cost_order)))

    @classmethod
    def of_jobs(cls, jobs: Any) -> ValidationCost:
        """From JobRecords with their attempts (a run page's, a listing's)."""
        groups: dict[tuple[str, str, str | None], list[float]] = {}
        for job in jobs:
            for attempt in job.attempt_history:
                if attempt.running_s is None:
                    continue
                key = (job.validator, job.pool, attempt.accelerator_type)
                found = groups.setdefault(key, [0, 0.0, 0.0])
                found[0] += 1
                found[1] += attempt.running_s
                found[2] += attempt.accelerator_s or 0.0
        return cls.of_rows((*key, *values) for key, values in groups.items())


def costs_by_run(rows: Any) -> dict[int, ValidationCost]:
    """Run id (or report index) -> its ValidationCost, from rows of (run id, validator,
    pool, accelerator type, attempts, running_s, accelerator_s): registry/costs.py's
    statements."""
    by_run: dict[int, list[tuple]] = {}
    for run_id, *line in rows:
        by_run.setdefault(run_id, []).append(tuple(line))
    return {run_id: ValidationCost.of_rows(lines) for run_id, lines in by_run.items()}


def _cost_order(line: CostLine) -> tuple[str, str, str]:
    return (line.validator, line.pool, line.accelerator_type or "")


@dataclasses.dataclass(frozen=True)
class ReportCall:
    """One report() call of one rank of a worker group (made on the training thread, so
    a plain record: registry/assemblies.py keeps the rows of its assembly)."""

    worker_group: str  # the same on every rank of the group, new for a restarted group
    call: int  # 1 for the rank's first report() call in this group
    rank: int
    world_size: int

    @property
    def group_key(self) -> str:
        """The key of this call's assembly: the same on every rank."""
        return f"{self.worker_group}-{self.call}"
