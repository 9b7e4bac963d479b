"""Ray Tune's ASHA on validated metrics: how long after a validation ends the scheduler
decides on it, and how many trial-epochs the search runs, against validating inline.

The same search runs twice on one local Ray (tests/tune_search.py: 4 trials, two
learning rates that learn and two that stay at chance, 1 Ray Train worker each):

- ckval: trainer_integration.report(..., validate_fn=...) and ckval's TuneReportCallback;
  training never waits for a validation, Tune gets each result once it is validated;
- inline: the validation runs inside the training loop and the epoch reports val_acc
  with ray.train.report and Ray's own TuneReportCallback (Ray's only way for Tune's
  scheduler to see a validated metric today).

Latency: a Tune callback on the driver notes when Tune processed each result (just after
the scheduler's on_trial_result); the registry has when its validation job finished.

    .venv/bin/python benchmarks/bench_tune.py [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import command_line, fresh_ckval_home, load_average  # noqa: E402


def _decision_clock():
    import ray.tune

    class DecisionClock(ray.tune.Callback):
        """When Tune processed each result: right after its scheduler decided on it."""

        def __init__(self):
            self.seen: list[tuple[str, int, float]] = []

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if "ckval_report_index" in result:
                self.seen.append((trial.trial_id, result["ckval_report_index"], time.time()))

    return DecisionClock()


def _search(inline: bool, args, storage: str):
    from ray.tune.schedulers import ASHAScheduler

    from tests.tune_search import GOOD_LRS, POOR_LRS, run_search

    clock = _decision_clock()
    scheduler = ASHAScheduler(
        time_attr="epoch", metric="val_acc", mode="max", grace_period=2, max_t=args.epochs
    )
    started = time.monotonic()
    grid = run_search(
        scheduler,
        name=f"bench-{'inline' if inline else 'ckval'}-{uuid.uuid4().hex[:6]}",
        storage_path=storage,
        lrs=GOOD_LRS + POOR_LRS,
        epochs=args.epochs,
        callbacks=[clock],
        inline=inline,
        epoch_s=args.epoch_s,
        validation_s=args.validation_s,
    )
    wall_s = time.monotonic() - started
    epochs = {r.config["lr"]: int(r.metrics_dataframe["epoch"].max()) + 1 for r in grid}
    return grid, clock, wall_s, epochs


def _latencies_ms(grid, clock) -> list[float]:
    """Validation end -> Tune processed its result, for every validated result."""
    from validation_service.registry.registry import Registry

    registry = Registry()
    finished: dict[tuple[str, int], float] = {}
    for result in grid:
        trial = result.metrics["trial_id"]
        for job in registry.validations(f"train-trial_id={trial}"):
            if job.finished_at is not None:
                finished[(trial, job.report_index)] = job.finished_at.timestamp()
    return [
        (decided - finished[(trial, index)]) * 1000
        for trial, index, decided in clock.seen
        if (trial, index) in finished
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epoch-s", type=float, default=2.0)
    parser.add_argument("--validation-s", type=float, default=0.5)
    parser.add_argument("--smoke", action="store_true", help="3 epochs of 0.5 s")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.epoch_s, args.validation_s = 3, 0.5, 0.2
    fresh_ckval_home("ckval-bench-tune-")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    import ray

    from validation_service.config import ckval_env, get_settings
    from validation_service.service import ValidationService

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start(settings=get_settings())
    storage = tempfile.mkdtemp(prefix="ckval-bench-tune-ray-")
    try:
        grid, clock, ckval_wall, ckval_epochs = _search(False, args, storage)
        latencies = sorted(_latencies_ms(grid, clock))
        _, _, inline_wall, inline_epochs = _search(True, args, storage)
    finally:
        service.stop()
        ray.shutdown()
    p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))] if latencies else None
    print(f"command: {command_line()}  load: {load_average()}")
    print(
        f"validation end -> scheduler decision: median {statistics.median(latencies):.0f} ms, "
        f"p90 {p90:.0f} ms ({len(latencies)} results)"
    )
    print(
        f"trial-epochs run: ckval {sum(ckval_epochs.values())} {ckval_epochs}; "
        f"inline {sum(inline_epochs.values())} {inline_epochs}"
    )
    print(f"search wall time: ckval {ckval_wall:.1f} s; inline {inline_wall:.1f} s")


if __name__ == "__main__":
    main()
