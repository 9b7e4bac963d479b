"""The README's early-stopping pattern as the first thing on a fresh Ray.

    python tests/cluster_programs/fresh_early_stop.py [--epochs N] [--epoch-s S]

Starts its own Ray (``ray.init()``, Ray Train's own health-check interval), sets
``StopPolicy("val_acc", patience=2)`` on the run, and trains a 2-worker TorchTrainer whose
every rank calls ``report(..., validate_fn=...)`` and then ``should_stop()`` each epoch;
the validated accuracy stops improving after epoch 3. Each rank writes down, per epoch,
when its report and should_stop returned and what should_stop said. Prints one JSON
summary (the decision and when it was recorded, each rank's epochs) as its last line.
CKVAL_HOME and RAY_TMPDIR come from the caller (else fresh temporary ones).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback

import _harness

PLATEAU_AFTER = 3


def validated_accuracy(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "epoch.json")) as f:
            epoch = json.load(f)["epoch"]
    return {"val_acc": min(epoch, PLATEAU_AFTER) / 10}


def train_func(config):
    import ray.train

    from trainer_integration import report, should_stop

    rank = ray.train.get_context().get_world_rank()
    epochs = []
    for epoch in range(config["epochs"]):
        time.sleep(config["epoch_s"])  # an epoch of training
        began = time.time()
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "epoch.json"), "w") as f:
                json.dump({"epoch": epoch}, f)
            checkpoint = ray.train.Checkpoint.from_directory(directory) if rank == 0 else None
            report({"epoch": epoch}, checkpoint, validate_fn=validated_accuracy)
        reported = time.time()
        stop = should_stop()
        epochs.append(
            {
                "epoch": epoch,
                "began": began,
                "reported": reported,
                "asked": time.time(),
                "stop": stop,
            }
        )
        if stop:
            break
    with open(os.path.join(config["scratch"], f"rank-{rank}.json"), "w") as f:
        json.dump(epochs, f)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--epoch-s", type=float, default=0.6)
    args = parser.parse_args()

    home = _harness.ckval_home()
    ray_tmpdir = _harness.private_ray_tmpdir()
    # As a user's program runs: Ray Train's own interval between looks at its workers, and
    # Ray's worker processes started for its first driver.
    os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    os.environ.pop("RAY_prestart_worker_first_driver", None)
    os.environ.pop("CKVAL_KEEP_WARM", None)
    summary: dict = {"scenario": "fresh_early_stop", "home": str(home), "ray_tmpdir": ray_tmpdir}
    run = "fresh-early-stop"
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from validation_service import Registry, StopPolicy

        ray.init(num_cpus=4, include_dashboard=False)
        Registry().set_stop_policy(run, StopPolicy("val_acc", mode="max", patience=2))
        scratch = tempfile.mkdtemp()
        TorchTrainer(
            train_func,
            train_loop_config={"epochs": args.epochs, "epoch_s": args.epoch_s, "scratch": scratch},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=run, storage_path=str(home / "ray_results")),
        ).fit()
        registry = Registry()
        decision = registry.stop_decision(run)
        ranks = {}
        for rank in (0, 1):
            with open(os.path.join(scratch, f"rank-{rank}.json")) as f:
                ranks[rank] = json.load(f)
        summary.update(
            ok=True,
            decided_at=decision.decided_at.timestamp() if decision else None,
            decided_report=decision.report_index if decision else None,
            ranks=ranks,
        )
    except BaseException:  # noqa: BLE001 - reported in the summary
        summary.update(ok=False, error=traceback.format_exc())
    summary["teardown_errors"] = _harness.run_all(_shutdown_ray)
    _harness.emit(summary)
    return 0 if summary["ok"] else 1


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()
    _harness.kill_processes_with(os.environ["RAY_TMPDIR"])


if __name__ == "__main__":
    raise SystemExit(main())
