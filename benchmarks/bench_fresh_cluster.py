"""What report() and should_stop() cost a training loop, on a fresh Ray and a warm one;
how soon the first validated metric of a fresh Ray is there; how long a restart after a
worker failure takes. ckval against Ray's own calls, in the same run.

A TorchTrainer with 2 workers runs ``--epochs`` epochs of ``--epoch-s`` seconds (a sleep
standing for the training) and, after each, rank 0 saves a small model file. The ways:

- ``loop``: no report at all: the floor;
- ``ray``: ``ray.train.report(metrics, checkpoint, checkpoint_upload_mode=ASYNC,
  validation=True)`` with ``TorchTrainer(validation_config=ValidationConfig(fn))``, the
  call of Ray's async-validation guide (2.51-2.53: ``validate_fn=fn``);
- ``ckval``: ``trainer_integration.report(..., validate_fn=fn,
  checkpoint_upload_mode=ASYNC)`` then ``should_stop()`` on every rank, with
  ``trainer_integration`` imported by the training code as the README's programs import
  it (so a worker imports it as it unpickles the train function, and ckval's set-up
  starts with training); Ray's way never imports it.

A way's overhead per epoch is the median epoch wall time less ``--epoch-s``. "first
validated" runs from the first report() call to the moment the first validated metric can
be read (Ray: when its validation function returns; ckval: when the registry holds it).
Each measurement on a "fresh" Ray is its own process (``ray.init()``, no ckval service:
ckval's set-up starts it); "warm" is a second run of the same way in that process.

``--part resume``: one worker fails once, at once after its report of an epoch
(``--fail-at``, ``FailureConfig(max_failures=1)``); the time from the failure to the
restarted workers' first line, and the epoch they resume at, for Ray's own report and
ckval's.

    .venv/bin/python benchmarks/bench_fresh_cluster.py --repeats 3 --out /tmp/fresh.md
    .venv/bin/python benchmarks/bench_fresh_cluster.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description

import trainer_integration

WAYS = ("loop", "ray", "ckval")
CLUSTERS = ("fresh", "warm")


def validate_fn(checkpoint, config=None, **kwargs) -> dict:
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "model.pt"))
    if kwargs.get("marks"):
        open(os.path.join(kwargs["marks"], f"validated-{time.time()}"), "w").close()
    return {"weight": float(state["weight"].sum())}


def train_func(config):
    import ray.train

    way, marks = config["way"], config["marks"]
    rank = ray.train.get_context().get_world_rank()
    checkpoint = ray.train.get_checkpoint()
    start = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = torch.load(os.path.join(directory, "model.pt"))["epoch"] + 1
    if os.path.exists(os.path.join(marks, "failed")):  # a restart: at epoch 0 without one
        with open(os.path.join(marks, f"resumed-{rank}"), "w") as f:
            json.dump({"at": time.time(), "epoch": start}, f)
    times = []
    for epoch in range(start, config["epochs"]):
        began = time.time()
        time.sleep(config["epoch_s"])
        if way != "loop":
            _report(config["report"], epoch, rank, marks)
        times.append(time.time() - began)
        failed = os.path.join(marks, "failed")
        if config.get("fail_at") == epoch and rank == 1 and not os.path.exists(failed):
            with open(failed, "w") as f:
                f.write(str(time.time()))
            raise RuntimeError("a worker fails once")
    with open(os.path.join(marks, f"epochs-{rank}-{uuid.uuid4().hex[:6]}.json"), "w") as f:
        json.dump(times, f)


def _report(report, epoch: int, rank: int, marks: str) -> None:
    import ray.train

    folder = None
    if rank == 0:
        folder = tempfile.mkdtemp(dir=marks)
        state = {"weight": torch.full((64,), float(epoch)), "epoch": epoch}
        torch.save(state, os.path.join(folder, "model.pt"))
        if epoch == 0:
            with open(os.path.join(marks, "first-report"), "w") as f:
                f.write(str(time.time()))
    checkpoint = ray.train.Checkpoint.from_directory(folder) if folder else None
    report(epoch, checkpoint, marks)


def ray_report(epoch: int, checkpoint, marks: str) -> None:
    import ray.train

    from validation_service._ray_compat import native_validation

    kwargs = native_validation(validate_fn, {"marks": marks}).report_kwargs if checkpoint else {}
    mode = ray.train.CheckpointUploadMode.ASYNC
    ray.train.report({"epoch": epoch}, checkpoint, checkpoint_upload_mode=mode, **kwargs)


def ckval_report(epoch: int, checkpoint, marks: str) -> None:
    import ray.train

    # Imported here: the train loop config that carries this function is unpickled
    # before the worker's train context exists (see ckval_train_func).
    from trainer_integration import report, should_stop

    fn = validate_fn if checkpoint else None
    mode = ray.train.CheckpointUploadMode.ASYNC
    report({"epoch": epoch}, checkpoint, validate_fn=fn, checkpoint_upload_mode=mode)
    should_stop()


def ckval_train_func(config):
    """train_func, in a training script that imported ``trainer_integration``: a worker
    imports it as it unpickles the function, in its train context (ckval's set-up starts
    then, with training). The train loop config is unpickled before that context."""
    assert trainer_integration.report is not None
    train_func(config)


def fit(way: str, marks: str, epochs: int, epoch_s: float, **config) -> str:
    """Runs the way's training; returns its run name."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from validation_service._ray_compat import native_validation

    trainer_kwargs = {}
    if way == "ray":
        trainer_kwargs = native_validation(validate_fn, {"marks": marks}).trainer_kwargs
    run = f"fresh-{way}-{uuid.uuid4().hex[:6]}"
    TorchTrainer(
        ckval_train_func if way == "ckval" else train_func,
        train_loop_config={
            "way": way,
            "marks": marks,
            "epochs": epochs,
            "epoch_s": epoch_s,
            "report": {"ray": ray_report, "ckval": ckval_report}.get(way),
            **config,
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run, storage_path=tempfile.mkdtemp(), failure_config=FailureConfig(max_failures=1)
        ),
        **trainer_kwargs,
    ).fit()
    return run


def first_validated_s(way: str, run: str, marks: str) -> float | None:
    """Seconds from the first report() call to the first validated metric."""
    with open(os.path.join(marks, "first-report")) as f:
        first = float(f.read())
    if way == "ray":
        names = [n for n in os.listdir(marks) if n.startswith("validated-")]
        stamps = [float(n.split("-", 1)[1]) for n in names]
        return min(stamps) - first if stamps else None
    from validation_service.registry.registry import Registry

    registry = Registry()
    deadline = time.time() + 120
    while time.time() < deadline:
        validated = [j.finished_at for j in registry.validations(run) if j.status == "SUCCEEDED"]
        if validated:
            return min(validated).timestamp() - first
        time.sleep(0.05)
    return None


def measure_once(way: str, epochs: int, epoch_s: float) -> dict:
    """One process: the way on a fresh Ray, then again on the same (warm) Ray."""
    import ray

    fresh_ckval_home("ckval-bench-fresh-")
    os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    for cluster in ("fresh", "warm"):
        marks = tempfile.mkdtemp(prefix="bench-fresh-marks-")
        run = fit(way, marks, epochs, epoch_s)
        times = []
        for name in os.listdir(marks):
            if name.startswith("epochs-"):
                with open(os.path.join(marks, name)) as f:
                    times += json.load(f)[1:]  # the first epoch pays for set-up alike
        out[cluster] = {"overhead_ms": 1000 * (statistics.median(times) - epoch_s)}
        if way != "loop":
            out[cluster]["first_validated_s"] = first_validated_s(way, run, marks)
    ray.shutdown()
    return out


def resume_once(way: str, epochs: int, epoch_s: float, fail_at: int = 2) -> dict:
    import ray

    fresh_ckval_home("ckval-bench-resume-")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    marks = tempfile.mkdtemp(prefix="bench-resume-marks-")
    fit(way, marks, epochs, epoch_s, fail_at=fail_at)
    ray.shutdown()
    with open(os.path.join(marks, "failed")) as f:
        failed = float(f.read())
    resumed = []
    for rank in (0, 1):
        with open(os.path.join(marks, f"resumed-{rank}")) as f:
            resumed.append(json.load(f))
    return {
        "restart_s": max(r["at"] for r in resumed) - failed,
        "resumed_at_epoch": min(r["epoch"] for r in resumed),
    }


def run_in_process(part: str, way: str, epochs: int, epoch_s: float, fail_at: int = 2) -> dict:
    command = [sys.executable, __file__, "--one", part, way, str(epochs), str(epoch_s)]
    command.append(str(fail_at))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CKVAL_HOME")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict, repeats: int, epoch_s: float) -> list[str]:
    lines = [
        f"Overhead per epoch (median of each run's epochs less the {epoch_s} s of "
        f"training, then the median of {repeats} runs), and the time from the first "
        "report to the first validated metric:",
        "",
        "| way | fresh: overhead ms | warm: overhead ms | fresh: first validated s | "
        "warm: first validated s |",
        "|---|---:|---:|---:|---:|",
    ]
    for way in WAYS:
        runs = results.get(way, [])
        if not runs:
            continue

        cells = [
            _median(runs, c, k) for k in ("overhead_ms", "first_validated_s") for c in CLUSTERS
        ]
        lines.append(f"| {way} | " + " | ".join(cells[i] for i in (0, 1, 2, 3)) + " |")
    return lines


def _median(runs: list[dict], cluster: str, key: str) -> str:
    values = [r[cluster][key] for r in runs if r[cluster].get(key) is not None]
    digits = 0 if key == "overhead_ms" else 2
    return f"{statistics.median(values):.{digits}f}" if values else "-"


def resume_table(results: dict, epoch_s: float) -> list[str]:
    lines = [
        "",
        f"A worker fails 0 s after its report of an epoch ({epoch_s} s epochs, "
        "FailureConfig(max_failures=1)); the time from the failure until both restarted "
        "workers began, and the epoch they resumed at (0: from the start):",
        "",
        "| failure after epoch | way | restart until resumed s (median) | resumed at epoch |",
        "|---:|---|---:|---|",
    ]
    for (fail_at, way), runs in results.items():
        restart = statistics.median(r["restart_s"] for r in runs)
        epochs = ", ".join(str(r["resumed_at_epoch"]) for r in runs)
        lines.append(f"| {fail_at} | {way} | {restart:.1f} | {epochs} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--epoch-s", type=float, default=0.6)
    parser.add_argument("--part", choices=("overhead", "resume", "all"), default="all")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--fail-at",
        type=int,
        nargs="+",
        default=[2, 8],
        help="the epochs after whose report a worker fails (--part resume), one run each",
    )
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        part, way, epochs, epoch_s, fail_at = args.one
        pickle_by_value(__name__)
        if part == "overhead":
            print(json.dumps(measure_once(way, int(epochs), float(epoch_s))))
        else:
            print(json.dumps(resume_once(way, int(epochs), float(epoch_s), int(fail_at))))
        return 0
    if args.smoke:
        args.repeats, args.epochs, args.epoch_s = 1, 4, 0.2
    load_before = load_average()
    lines = []
    if args.part in ("overhead", "all"):
        results: dict[str, list] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:  # rotated per repeat: each sees the machine alike
                once = run_in_process("overhead", way, args.epochs, args.epoch_s)
                results[way].append(once)
                print(f"overhead, {way}: {once}", file=sys.stderr)
        lines += table(results, args.repeats, args.epoch_s)
    if args.part in ("resume", "all"):
        resumed = {(fail_at, way): [] for fail_at in args.fail_at for way in ("ray", "ckval")}
        for _ in range(args.repeats):
            for fail_at, way in resumed:
                epochs = max(args.epochs, fail_at + 3)
                once = run_in_process("resume", way, epochs, args.epoch_s, fail_at)
                resumed[fail_at, way].append(once)
                print(f"resume, failure after epoch {fail_at}, {way}: {once}", file=sys.stderr)
        lines += resume_table(resumed, args.epoch_s)
    header = run_description(load_before)
    text = "\n".join([*(f"- {k}: {v}" for k, v in header.items()), "", *lines])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
