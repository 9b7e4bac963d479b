"""Early stopping on validated metrics: the public ``StopPolicy`` and the pure rules that
decide, from one run's validated values in report order (and earlier runs' curves for
median stopping), whether the run should stop. No database: registry/stopping.py reads
the values, asks ``decide`` and stores its ``Verdict``.

The rules, checked at each validated checkpoint in report order; the first that fires
decides (when several fire at one checkpoint: divergence, threshold, patience, median):

- **patience** N: as Keras' and Lightning's ``EarlyStopping``: the best value so far moves
  only on an improvement by more than ``min_delta`` (max: ``v > best + min_delta``, min:
  ``v < best - min_delta``); the run stops once N validated values in a row bring none.
  A NaN or infinite value is never an improvement.
- **threshold** T: the value reached the target: ``v >= T`` (max) or ``v <= T`` (min).
- **divergence** F (a number > 1): the value is NaN or infinite, or worse than the best so
  far by the factor F: min: ``v - best > (F - 1) * |best|`` (a loss of 0.5 diverges above
  0.5 * F); max: ``best - v > (1 - 1 / F) * |best|`` (an accuracy of 0.8 diverges below
  0.8 / F). With a best of exactly 0 any worse value counts as diverged.
- **median_of_runs**: the value is worse than the median of the earlier runs' values at
  the same step (strictly below it for max, above it for min), judged only from the
  ``warmup + 1``-th validated value of the run on. A checkpoint's step is its reported
  ``step``, else its report index; an earlier run's value "at step s" is that of its last
  validated checkpoint at or before s (a run with none there does not count). No earlier
  run with a value at s: no decision.

A checkpoint whose validation is still QUEUED or RUNNING holds back every later one (the
rules read the values in report order, never around a gap). One whose validation FAILED,
TIMED_OUT or was CANCELLED, or whose validated metrics lack a number for the metric, never
decides: it is skipped, and the verdict lists it. A checkpoint reported without a
``validate_fn`` is not a validated checkpoint and is passed over.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from validation_service.errors import InvalidInput
from validation_service.jobs import ValidationStatus

RULES = ("divergence", "threshold", "patience", "median_of_runs")
# The checkpoint's validation_status values the rules read.
VALIDATED = ValidationStatus.VALIDATED.value
AWAITED = frozenset({ValidationStatus.PENDING.value, ValidationStatus.RUNNING.value})
UNVALIDATED = ValidationStatus.NONE.value
# A metric name is stored in a 255-character column.
_MAX_METRIC_LENGTH = 255


@dataclasses.dataclass(frozen=True)
class StopPolicy:
    """When a run should stop, by one validated metric (see the module's docstring for the
    exact rules). At least one of ``patience``, ``threshold``, ``divergence`` and
    ``median_of_runs`` must be given; ``warmup`` goes with ``median_of_runs``.

    >>> StopPolicy("val_loss", mode="min", patience=3, min_delta=0.01, divergence=4.0)
    """

    metric: str
    mode: Literal["max", "min"] = "max"
    patience: int | None = None
    min_delta: float = 0.0
    threshold: float | None = None
    divergence: float | None = None
    median_of_runs: bool = False
    warmup: int = 0

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if self.mode not in ("max", "min"):
            raise InvalidInput(
                f"StopPolicy mode must be 'max' (higher is better) or 'min' (lower is "
                f"better), got {self.mode!r}"
            )
        if self.patience is not None and not _is_int(self.patience, least=1):
            raise InvalidInput(
                f"StopPolicy patience must be a whole number of validated checkpoints from 1 "
                f"to {_MOST} (or None for no patience rule), got {self.patience!r}"
            )
        if not _is_number(self.min_delta) or not math.isfinite(self.min_delta):
            raise InvalidInput(
                f"StopPolicy min_delta must be a finite number >= 0, got {self.min_delta!r}"
            )
        if self.min_delta < 0:
            raise InvalidInput(
                f"StopPolicy min_delta must be >= 0 (the least change that counts as an "
                f"improvement), got {self.min_delta!r}"
            )
        self._check_numbers()
        if not isinstance(self.median_of_runs, bool):
            raise InvalidInput(
                f"StopPolicy median_of_runs must be True or False, got {self.median_of_runs!r}"
            )
        if not _is_int(self.warmup, least=0):
            raise InvalidInput(
                f"StopPolicy warmup must be a whole number of validated reports from 0 to "
                f"{_MOST}, got {self.warmup!r}"
            )
        if self.warmup and not self.median_of_runs:
            raise InvalidInput(
                f"StopPolicy warmup={self.warmup} applies only to median stopping: pass "
                "median_of_runs=True with it, or leave warmup out"
            )
        if not self.rules:
            raise InvalidInput(
                f"StopPolicy for {self.metric!r} sets no rule: pass at least one of "
                "patience=N, threshold=T, divergence=F (> 1) or median_of_runs=True"
            )
        self._normalize()

    def _normalize(self) -> None:
        """Plain int and float values (a NumPy number stores and compares as one)."""
        for name, kind in (("patience", int), ("threshold", float), ("divergence", float)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, kind(value))
        object.__setattr__(self, "min_delta", float(self.min_delta))
        object.__setattr__(self, "warmup", int(self.warmup))

    def _check_numbers(self) -> None:
        if self.threshold is not None and not (
            _is_number(self.threshold) and math.isfinite(self.threshold)
        ):
            raise InvalidInput(
                f"StopPolicy threshold must be a finite number (the target value of "
                f"{self.metric!r}), or None, got {self.threshold!r}"
            )
        if self.divergence is not None and not (
            _is_number(self.divergence) and math.isfinite(self.divergence) and self.divergence > 1
        ):
            raise InvalidInput(
                f"StopPolicy divergence must be a finite factor > 1 (e.g. 2.0: twice as bad "
                f"as the best value), or None, got {self.divergence!r}"
            )

    @property
    def rules(self) -> tuple[str, ...]:
        """The rules this policy sets, in the order they are checked."""
        given = {
            "divergence": self.divergence is not None,
            "threshold": self.threshold is not None,
            "patience": self.patience is not None,
            "median_of_runs": self.median_of_runs,
        }
        return tuple(rule for rule in RULES if given[rule])

    def to_dict(self) -> dict[str, Any]:
        """The policy as plain JSON values (StopPolicy.from_mapping reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> StopPolicy:
        """A policy from a JSON object (the HTTP API's body); an unknown key or a missing
        metric is InvalidInput naming it."""
        if not isinstance(values, Mapping):
            raise InvalidInput(f"a stop policy is a JSON object, got {values!r}")
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in values if key not in known)
        if unknown:
            raise InvalidInput(
                f"unknown stop policy field(s) {', '.join(unknown)}: use {', '.join(known)}"
            )
        if "metric" not in values:
            raise InvalidInput("a stop policy needs metric: the validated metric it watches")
        return cls(**values)

    def describe(self) -> str:
        """One line for people: ``accuracy (max): patience 3 (min_delta 0.01), threshold 0.95``."""
        parts = []
        if self.patience is not None:
            delta = f" (min_delta {self.min_delta:g})" if self.min_delta else ""
            parts.append(f"patience {self.patience}{delta}")
        if self.threshold is not None:
            parts.append(f"threshold {self.threshold:g}")
        if self.divergence is not None:
            parts.append(f"divergence x{self.divergence:g}")
        if self.median_of_runs:
            parts.append(f"median of earlier runs after {self.warmup} report(s)")
        return f"{self.metric} ({self.mode}): {', '.join(parts)}"


def _check_metric(metric: Any) -> None:
    if not isinstance(metric, str) or not metric.strip():
        raise InvalidInput(
            f"StopPolicy metric must be the name of a validated metric (e.g. 'accuracy'), "
            f"got {metric!r}"
        )
    if len(metric) > _MAX_METRIC_LENGTH:
        raise InvalidInput(
            f"StopPolicy metric must be at most {_MAX_METRIC_LENGTH} characters, got {len(metric)}"
        )


# The columns that store patience and warmup are 32-bit integers.
_MOST = 2**31 - 1


def _is_int(value: Any, *, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value) and least <= value <= _MOST


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # NumPy's bool


@dataclasses.dataclass(frozen=True)
class Observation:
    """One checkpoint of the run as the rules see it.

    ``status``: its validation_status; ``value``: its validated value of the policy's
    metric (None when the validated metrics have no number of that name).
    """

    report_index: int
    step: int | None
    status: str
    value: float | None = None

    @property
    def position(self) -> int:
        """Where the checkpoint is on the training curve: its step, else its report index."""
        return self.report_index if self.step is None else self.step


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What decided: the rule, the checkpoint, the values it looked at ((report index,
    value) pairs, in report order), what they were compared with (the best value, the
    target or the median), and the checkpoints skipped on the way ((report index, why))."""

    rule: str
    report_index: int
    reason: str
    values: tuple[tuple[int, float], ...]
    reference: float | None
    skipped: tuple[tuple[int, str], ...] = ()


class PeerCurves:
    """Earlier runs' validated values of one metric, by step, for median stopping."""

    def __init__(self, curves: Mapping[Any, Iterable[tuple[int, float]]]):
        # run -> positions ascending, and the value at each (the last one of a position).
        self._curves: list[tuple[list[int], list[float]]] = []
        for points in curves.values():
            by_position = dict(sorted(points, key=lambda point: point[0]))
            if by_position:
                self._curves.append((list(by_position), list(by_position.values())))

    def __len__(self) -> int:
        return len(self._curves)

    def median_at(self, position: int) -> tuple[float, int] | None:
        """The median of the runs' values at ``position`` (each run's last at or before it)
        and how many runs had one; None when none had."""
        values = []
        for positions, run_values in self._curves:
            at = bisect.bisect_right(positions, position)
            if at:
                values.append(run_values[at - 1])
        if not values:
            return None
        return statistics.median(values), len(values)


@dataclasses.dataclass
class _Progress:
    """What the rules carry from one validated value to the next."""

    best: float | None = None
    best_index: int | None = None
    since_best: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    judged: int = 0


def decide(
    policy: StopPolicy, observations: Sequence[Observation], peers: PeerCurves | None = None
) -> Verdict | None:
    """The first verdict of ``policy`` over the run's checkpoints (any order: read in report
    order), or None. ``peers``: the earlier runs' curves, for median_of_runs."""
    progress = _Progress()
    skipped: list[tuple[int, str]] = []
    for seen in sorted(observations, key=lambda o: o.report_index):
        if seen.status in AWAITED:
            break  # later checkpoints wait for this one's result
        if seen.status == UNVALIDATED:
            continue
        if seen.status != VALIDATED:
            skipped.append((seen.report_index, seen.status))
            continue
        if seen.value is None:
            skipped.append((seen.report_index, f"no value of {policy.metric!r}"))
            continue
        verdict = _judge(policy, seen, progress, peers)
        if verdict is not None:
            return dataclasses.replace(verdict, skipped=tuple(skipped))
    return None


def _judge(
    policy: StopPolicy, seen: Observation, progress: _Progress, peers: PeerCurves | None
) -> Verdict | None:
    """Adds one validated value to ``progress``; the verdict of the first rule it fires."""
    value = float(seen.value)  # type: ignore[arg-type]
    earlier_best, earlier_best_index = progress.best, progress.best_index
    improved = _improves(policy, value, progress.best)
    if improved:
        progress.best, progress.best_index = value, seen.report_index
        progress.since_best = []
    else:
        progress.since_best.append((seen.report_index, value))
    progress.judged += 1
    for rule in policy.rules:
        if rule == "divergence":
            verdict = _diverged(policy, seen, value, earlier_best, earlier_best_index)
        elif rule == "threshold":
            verdict = _reached(policy, seen, value)
        elif rule == "patience":
            verdict = _out_of_patience(policy, seen, progress)
        else:
            verdict = _below_median(policy, seen, value, progress, peers)
        if verdict is not None:
            return verdict
    return None


def _improves(policy: StopPolicy, value: float, best: float | None) -> bool:
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    if policy.mode == "max":
        return value > best + policy.min_delta
    return value < best - policy.min_delta


def _diverged(
    policy: StopPolicy,
    seen: Observation,
    value: float,
    best: float | None,
    best_index: int | None,
) -> Verdict | None:
    if not math.isfinite(value):
        reason = f"{policy.metric} is {value} at report {seen.report_index}"
        return _verdict_on_value("divergence", seen, value, reason, best)
    if best is None or best_index is None:
        return None
    factor = policy.divergence or 1.0
    if policy.mode == "min":
        worse = value - best > (factor - 1) * abs(best)
    else:
        worse = best - value > (1 - 1 / factor) * abs(best)
    if not worse:
        return None
    return Verdict(
        "divergence",
        seen.report_index,
        f"{policy.metric} {value:g} at report {seen.report_index} is worse than its best "
        f"{best:g} (report {best_index}) by more than a factor of {factor:g}",
        ((best_index, best), (seen.report_index, value)),
        best,
    )


def _verdict_on_value(
    rule: str, seen: Observation, value: float, reason: str, reference: float | None
) -> Verdict:
    """The verdict of a rule that looked at one checkpoint's value alone."""
    return Verdict(rule, seen.report_index, reason, ((seen.report_index, value),), reference)


def _as_good_as(mode: str, value: float, other: float) -> bool:
    """Whether ``value`` is at least as good as ``other`` (max: >=, min: <=)."""
    return value >= other if mode == "max" else value <= other


def _reached(policy: StopPolicy, seen: Observation, value: float) -> Verdict | None:
    target = policy.threshold
    assert target is not None
    if not _as_good_as(policy.mode, value, target):
        return None
    sign = ">=" if policy.mode == "max" else "<="
    reason = (
        f"{policy.metric} {value:g} at report {seen.report_index} reached the target "
        f"({sign} {target:g})"
    )
    return _verdict_on_value("threshold", seen, value, reason, target)


def _out_of_patience(policy: StopPolicy, seen: Observation, progress: _Progress) -> Verdict | None:
    patience = policy.patience
    assert patience is not None
    if len(progress.since_best) < patience:
        return None
    best, best_index = progress.best, progress.best_index
    values = tuple(progress.since_best[-patience:])
    if best is not None and best_index is not None:
        values = ((best_index, best), *values)
    best_text = "no finite value" if best is None else f"{best:g} (report {best_index})"
    delta = f" by more than {policy.min_delta:g}" if policy.min_delta else ""
    return Verdict(
        "patience",
        seen.report_index,
        f"{policy.metric} did not improve{delta} on {best_text} in the last {patience} "
        f"validated checkpoint(s), up to report {seen.report_index}",
        values,
        best,
    )


def _below_median(
    policy: StopPolicy,
    seen: Observation,
    value: float,
    progress: _Progress,
    peers: PeerCurves | None,
) -> Verdict | None:
    if peers is None or progress.judged <= policy.warmup:
        return None
    found = peers.median_at(seen.position)
    if found is None:
        return None
    median, count = found
    if _as_good_as(policy.mode, value, median):
        return None
    reason = (
        f"{policy.metric} {value:g} at step {seen.position} (report {seen.report_index}) is "
        f"worse than the median {median:g} of {count} earlier run(s) at that step"
    )
    return _verdict_on_value("median_of_runs", seen, value, reason, median)
