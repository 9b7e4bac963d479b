"""The early-stopping rules alone (validation_service/stopping.py, no database): the
policy's checks, patience, threshold, divergence and median stopping, report order,
checkpoints still awaited, and failed validations that never decide."""

from __future__ import annotations

import dataclasses
import math

import pytest

from validation_service import StopPolicy as ExportedStopPolicy
from validation_service.errors import InvalidInput
from validation_service.stopping import Observation, PeerCurves, StopPolicy, decide


def _validated(*values: float | None, first: int = 0) -> list[Observation]:
    return [Observation(first + i, None, "VALIDATED", value) for i, value in enumerate(values)]


def test_the_public_name_is_the_policy():
    assert ExportedStopPolicy is StopPolicy
    policy = StopPolicy("accuracy", patience=2)
    assert (policy.mode, policy.min_delta, policy.threshold, policy.warmup) == ("max", 0.0, None, 0)
    assert StopPolicy.from_mapping(policy.to_dict()) == policy
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.patience = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": "", "patience": 1}, "metric must be the name"),
        ({"metric": 3, "patience": 1}, "metric must be the name"),
        ({"metric": "m" * 256, "patience": 1}, "at most 255 characters"),
        ({"metric": "acc", "mode": "maximum", "patience": 1}, "mode must be 'max'"),
        ({"metric": "acc", "patience": 0}, "patience must be a whole number"),
        ({"metric": "acc", "patience": 2.5}, "patience must be a whole number"),
        ({"metric": "acc", "patience": True}, "patience must be a whole number"),
        ({"metric": "acc", "patience": 1, "min_delta": -0.1}, "min_delta must be >= 0"),
        ({"metric": "acc", "patience": 1, "min_delta": math.nan}, "min_delta must be a finite"),
        ({"metric": "acc", "patience": 1, "min_delta": "0.1"}, "min_delta must be a finite"),
        ({"metric": "acc", "threshold": math.inf}, "threshold must be a finite number"),
        ({"metric": "acc", "threshold": "high"}, "threshold must be a finite number"),
        ({"metric": "acc", "divergence": 1.0}, "divergence must be a finite factor > 1"),
        ({"metric": "acc", "divergence": math.inf}, "divergence must be a finite factor > 1"),
        ({"metric": "acc", "median_of_runs": "yes"}, "median_of_runs must be True or False"),
        ({"metric": "acc", "median_of_runs": True, "warmup": -1}, "warmup must be a whole"),
        ({"metric": "acc", "patience": 2, "warmup": 3}, "warmup=3 applies only to median"),
        ({"metric": "acc"}, "sets no rule: pass at least one of"),
    ],
)
def test_a_bad_policy_names_the_field_and_what_to_pass(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        StopPolicy(**kwargs)


def test_numpy_numbers_are_taken_as_plain_ones():
    np = pytest.importorskip("numpy")
    policy = StopPolicy("acc", patience=np.int64(3), min_delta=np.float32(0.5), warmup=0)
    assert policy.patience == 3 and type(policy.patience) is int
    assert type(policy.min_delta) is float and policy.min_delta == 0.5
    with pytest.raises(InvalidInput, match="patience must be a whole number"):
        StopPolicy("acc", patience=np.bool_(True))


def test_from_mapping_names_unknown_and_missing_fields():
    with pytest.raises(InvalidInput, match="unknown stop policy field.*patient.*use metric"):
        StopPolicy.from_mapping({"metric": "acc", "patient": 3})
    with pytest.raises(InvalidInput, match="needs metric"):
        StopPolicy.from_mapping({"patience": 3})
    with pytest.raises(InvalidInput, match="JSON object"):
        StopPolicy.from_mapping([1, 2])  # type: ignore[arg-type]


def test_patience_counts_checkpoints_without_an_improvement_by_more_than_min_delta():
    policy = StopPolicy("accuracy", patience=3, min_delta=0.01)
    # 0.5 is the best at 1; 0.505 is not better by more than 0.01; 0.52 is the new best at
    # 3; then three without an improvement by more than 0.01: 4, 5, 6 -> stops at 6.
    values = (0.4, 0.5, 0.505, 0.52, 0.52, 0.525, 0.51, 0.9)
    verdict = decide(policy, _validated(*values))
    assert verdict is not None and verdict.rule == "patience"
    assert verdict.report_index == 6
    assert verdict.reference == 0.52
    assert verdict.values == ((3, 0.52), (4, 0.52), (5, 0.525), (6, 0.51))
    assert "did not improve by more than 0.01 on 0.52 (report 3)" in verdict.reason
    assert decide(policy, _validated(*values[:6])) is None


def test_patience_in_min_mode_and_nan_is_never_an_improvement():
    policy = StopPolicy("loss", mode="min", patience=2)
    assert decide(policy, _validated(3.0, 2.0, 1.0, 0.5)) is None
    verdict = decide(policy, _validated(3.0, 2.0, math.nan, 2.0))
    assert verdict is not None and verdict.report_index == 3 and verdict.reference == 2.0


def test_threshold_fires_when_the_target_is_reached_in_either_mode():
    verdict = decide(StopPolicy("accuracy", threshold=0.95), _validated(0.5, 0.94, 0.95, 0.99))
    assert verdict is not None and (verdict.rule, verdict.report_index) == ("threshold", 2)
    assert verdict.values == ((2, 0.95),) and verdict.reference == 0.95
    loss = StopPolicy("loss", mode="min", threshold=0.1)
    verdict = decide(loss, _validated(0.5, 0.2, 0.1))
    assert verdict is not None and verdict.report_index == 2
    assert decide(loss, _validated(0.5, math.nan, 0.11)) is None


def test_divergence_on_nan_or_inf_and_by_a_factor_of_the_best():
    policy = StopPolicy("loss", mode="min", divergence=2.0)
    verdict = decide(policy, _validated(1.0, 0.5, math.inf))
    assert verdict is not None and (verdict.rule, verdict.report_index) == ("divergence", 2)
    assert verdict.values == ((2, math.inf),)
    # min: worse than 0.5 by a factor of 2 means above 1.0
    assert decide(policy, _validated(1.0, 0.5, 1.0)) is None
    verdict = decide(policy, _validated(1.0, 0.5, 1.01))
    assert verdict is not None and verdict.values == ((1, 0.5), (2, 1.01))
    assert verdict.reference == 0.5
    # max: worse than 0.8 by a factor of 2 means below 0.4
    accuracy = StopPolicy("accuracy", divergence=2.0)
    assert decide(accuracy, _validated(0.8, 0.4)) is None
    verdict = decide(accuracy, _validated(0.8, 0.39))
    assert verdict is not None and verdict.report_index == 1
    # a negative best (a log-likelihood): worse by |best| x (factor - 1)
    assert decide(StopPolicy("ll", mode="min", divergence=2.0), _validated(-2.0, 0.0)) is None
    verdict = decide(StopPolicy("ll", mode="min", divergence=2.0), _validated(-2.0, 0.1))
    assert verdict is not None
    verdict = decide(accuracy, _validated(math.nan))
    assert verdict is not None and verdict.reference is None


def test_when_several_rules_fire_at_one_checkpoint_divergence_comes_first():
    policy = StopPolicy("loss", mode="min", patience=1, threshold=0.01, divergence=2.0)
    verdict = decide(policy, _validated(1.0, 5.0))
    assert verdict is not None and verdict.rule == "divergence"
    policy = StopPolicy("loss", mode="min", patience=1, threshold=0.5)
    verdict = decide(policy, _validated(1.0, 1.0))
    assert verdict is not None and verdict.rule == "patience"


def test_failed_validations_never_decide_and_are_listed():
    policy = StopPolicy("accuracy", patience=2)
    observations = [
        Observation(0, None, "VALIDATED", 0.9),
        Observation(1, None, "FAILED"),
        Observation(2, None, "TIMED_OUT"),
        Observation(3, None, "CANCELLED"),
        Observation(4, None, "VALIDATED", None),  # the metric is missing
        Observation(5, None, "NONE"),  # reported without a validate_fn
        Observation(6, None, "VALIDATED", 0.8),
    ]
    assert decide(policy, observations) is None
    verdict = decide(policy, [*observations, Observation(7, None, "VALIDATED", 0.85)])
    assert verdict is not None and verdict.report_index == 7
    assert verdict.skipped == (
        (1, "FAILED"),
        (2, "TIMED_OUT"),
        (3, "CANCELLED"),
        (4, "no value of 'accuracy'"),
    )
    every_one_failed = [Observation(i, None, "FAILED") for i in range(10)]
    assert decide(StopPolicy("accuracy", patience=1, divergence=2.0), every_one_failed) is None


def test_a_checkpoint_still_awaited_holds_back_the_later_ones():
    policy = StopPolicy("accuracy", patience=1)
    observations = [
        Observation(2, None, "VALIDATED", 0.1),
        Observation(0, None, "VALIDATED", 0.9),
        Observation(1, None, "RUNNING"),
    ]
    assert decide(policy, observations) is None
    observations[2] = Observation(1, None, "VALIDATED", 0.8)
    verdict = decide(policy, observations)
    assert verdict is not None and verdict.report_index == 1


def test_median_of_runs_compares_at_the_same_step_after_the_warmup():
    peers = PeerCurves(
        {
            "a": [(0, 0.5), (10, 0.6), (20, 0.7)],
            "b": [(0, 0.4), (10, 0.5), (20, 0.8)],
            "c": [(5, 0.3), (15, 0.9)],
        }
    )
    # at step 12: a 0.6 (step 10), b 0.5 (step 10), c 0.3 (step 5): median 0.5
    assert peers.median_at(12) == (0.5, 3)
    # before any run has a value at or before step 0 ... c has none at 0
    assert peers.median_at(0) == (0.45, 2)
    assert peers.median_at(-1) is None
    policy = StopPolicy("accuracy", median_of_runs=True, warmup=1)
    run = [
        Observation(0, 0, "VALIDATED", 0.1),  # below the median, but within the warm-up
        Observation(1, 12, "VALIDATED", 0.55),
        Observation(2, 20, "VALIDATED", 0.6),  # median at 20: a .7, b .8, c .9 (15) -> .8
    ]
    verdict = decide(policy, run, peers)
    assert verdict is not None and (verdict.rule, verdict.report_index) == ("median_of_runs", 2)
    assert verdict.reference == 0.8 and "median 0.8 of 3 earlier run(s)" in verdict.reason
    assert decide(policy, run, PeerCurves({})) is None
    assert decide(policy, run, None) is None


def test_median_of_runs_in_min_mode_uses_report_indices_without_steps():
    peers = PeerCurves({"a": [(0, 1.0), (1, 0.8)], "b": [(0, 1.2), (1, 0.6)]})
    policy = StopPolicy("loss", mode="min", median_of_runs=True)
    assert decide(policy, _validated(1.1, 0.7), peers) is None
    verdict = decide(policy, _validated(1.1, 0.71), peers)
    assert verdict is not None and verdict.report_index == 1 and verdict.reference == 0.7


def test_describe_names_every_rule():
    policy = StopPolicy(
        "loss", mode="min", patience=3, min_delta=0.01, threshold=0.1, divergence=2,
        median_of_runs=True, warmup=2,
    )  # fmt: skip
    assert policy.describe() == (
        "loss (min): patience 3 (min_delta 0.01), threshold 0.1, divergence x2, "
        "median of earlier runs after 2 report(s)"
    )
    assert policy.rules == ("divergence", "threshold", "patience", "median_of_runs")
