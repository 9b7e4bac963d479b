"""Headline benchmark: ckval vs Ray Train's built-in async validation, on CPU.

It reproduces the shape of Ray's own release benchmark
(ray-project/ray, release/train_tests/async_checkpointing_validation_benchmark/), on a
small model that runs anywhere: a TorchTrainer with 2 workers trains an MLP on the
scikit-learn digits shipped in the package, reports a checkpoint every K steps, and each
checkpoint is validated three ways, in one run of this script:

- ``inline``: rank 0 validates inside the training loop, then ``ray.train.report``;
- ``native``: ``TorchTrainer(validation_config=ValidationConfig(fn=...))`` and
  ``ray.train.report(metrics, checkpoint, checkpoint_upload_mode=ASYNC, validation=True)``
  on a ``tempfile.mkdtemp()`` folder, the call of Ray's async-validation guide (Ray Train
  2.60: ``fn`` is called as ``fn(checkpoint, **fn_kwargs)``; Ray deletes the folder once
  uploaded; Ray 2.51-2.53 spell it ``ray.train.report(..., validate_fn=fn,
  validate_config=kwargs)``, which the benchmark uses there). Every rank reports in ASYNC
  mode;
- ``native-sync``: the same in Ray's default SYNC mode;
- ``ckval``: ``trainer_integration.report(..., validate_fn=..., validate_config=...)``
  (SYNC, its default) with the ckval service started with 2 concurrent CPU validations;
- ``ckval-async``: the same with ``checkpoint_upload_mode=ASYNC`` on a ``mkdtemp()``
  folder, as in Ray's guide.

All three use the same model, data, seeds, data order, number of checkpoints and the
same validation function (``validate_checkpoint``): accuracy over the held-out digits
plus accuracy over ``noisy_copies`` Gaussian-noised copies of the held-out set, both with
torchmetrics. The number of noisy copies is calibrated on the driver so that one
validation costs about ``--validation-seconds`` of real compute (no sleeping).
Native and ckval validations each ask for 1 CPU.

Measured per way, as in Ray's release benchmark:

- e2e: ``fit()`` start until the driver holds every validated metric (for ckval: until
  ``Registry().wait(run)`` returns after ``fit()``);
- report blocked: sum over reports of the time ``ray.train.report`` / ckval's
  ``report()`` held training: per report, the longest any rank was blocked in it (the
  ranks of a DDP run step together, so one rank's wait holds them all). Ray's first
  report of a run waits on its rank-synchronisation actor once, on whichever rank
  arrives first: timing rank 0 alone charges that wait to one way or the other by
  chance;
- in-loop validation: time rank 0 spent validating inside the loop (inline only);
- final wait: training loop end until the last validated metric is available: for
  native, when its last validation task finished computing (in the controller's memory;
  the user sees it only when ``fit()`` returns, so this is generous to native); for
  ckval, when the last job's metrics were committed to the registry (queryable from any
  process from then on, while Ray Train is still shutting the run down); inline: 0;
- until fit(): training loop end until ``fit()`` returned and the driver holds every
  validated metric (this includes Ray Train's shutdown of the run, the same in every way);
- blocking = report blocked + in-loop validation + final wait;
- total validation: sum of the validate_fn durations; best accuracy over checkpoints.

Before the measured runs, one short untimed run per way starts Ray's workers and imports
torch in them, as in a long-running service (``--no-warmup`` measures from cold).

Scenarios: ``backlog`` trains for 0.5x the validation time between checkpoints,
``no-backlog`` for 3x. The checkpoint interval K is calibrated with a short
TorchTrainer run that times training steps. Note that in every way ``ray.train.report``
blocks while the previous report is still unconsumed (each worker's result queue holds
one, and the controller drains it on its ~2 s poll), so checkpoints less than ~2 s apart
are paced by report(): with 1 s validations even ``backlog`` hardly backs up; use
``--validation-seconds 3`` for a real backlog.

Reproduce the main table of benchmarks/results/async_validation.md (the other commands
are listed there)::

    .venv/bin/python benchmarks/bench_async_validation.py --scenario backlog \\
        --checkpoints 6 --validation-seconds 1 --repeats 3 --out /tmp/async_validation.md

Smoke test (CI, a couple of minutes)::

    .venv/bin/python benchmarks/bench_async_validation.py --smoke

The rows, the tables and their checks are in ``_async_results.py``, the command line in
``_async_options.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from _async_options import SCENARIOS, parse_args
from _async_results import (
    WayResult,
    check_results,
    ckval_latency,
    median_result,
    render_markdown,
    way_result,
)
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description
from torch import nn

from validation_service._ray_compat import native_validation
from validation_service.cli.demo import load_digits_split, make_model

SEED = 0
LR = 0.1
BATCH_SIZE = 32
NOISE_STD = 0.3
NUM_WORKERS = 2
SMOKE_STEP_S = 0.005  # --smoke skips the step calibration run (one TorchTrainer less)


# ---------------------------------------------------------------------------- validation
def validate_checkpoint(
    checkpoint, noisy_copies: int, noise_std: float = NOISE_STD, seed: int = SEED
) -> dict[str, float]:
    """The one validation all three ways run: real torchmetrics compute, no sleeping.

    ``accuracy``/``val_loss`` on the held-out digits (as the demo's validate_digits), and
    ``noisy_accuracy`` over ``noisy_copies`` seeded Gaussian-noised copies of them.
    The metrics never sync across processes: inline, only rank 0 of a DDP group runs
    this, and torchmetrics' default sync would wait forever for the other rank.
    """
    import torchmetrics

    torch.set_num_threads(1)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # inline: leave the training RNG untouched
        model = make_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), map_location="cpu"))
    model.eval()
    _, x_val, _, y_val = load_digits_split()
    x, y = torch.from_numpy(x_val), torch.from_numpy(y_val).long()
    local = {"sync_on_compute": False}
    accuracy = torchmetrics.classification.MulticlassAccuracy(10, average="micro", **local)
    val_loss = torchmetrics.MeanMetric(**local)
    noisy_accuracy = torchmetrics.classification.MulticlassAccuracy(10, average="micro", **local)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(x)
        accuracy.update(logits, y)
        val_loss.update(nn.functional.cross_entropy(logits, y, reduction="none"))
        for _ in range(noisy_copies):
            noisy = (x + noise_std * torch.randn(x.shape, generator=generator)).clamp_(0.0, 1.0)
            noisy_accuracy.update(model(noisy), y)
    return {
        "accuracy": accuracy.compute().item(),
        "val_loss": val_loss.compute().item(),
        "noisy_accuracy": noisy_accuracy.compute().item() if noisy_copies else float("nan"),
        "validation_time": time.perf_counter() - started,
        "finished_at": time.time(),  # wall clock: when this validated metric existed
    }


def native_validate_fn(checkpoint, **kwargs) -> dict[str, float]:
    """Ray's ValidationFn signature: fn(checkpoint, **fn_kwargs)."""
    return validate_checkpoint(checkpoint, **kwargs)


def ckval_validate_fn(checkpoint, config: dict) -> dict[str, float]:
    """ckval's validate_fn signature: fn(checkpoint, validate_config)."""
    return validate_checkpoint(checkpoint, **config)


# ------------------------------------------------------------------------ training loop
def train_func(config: dict[str, Any]) -> None:
    """One TorchTrainer loop for every way; only how a checkpoint is reported differs."""
    import ray.train
    import ray.train.torch

    if config["way"].startswith("ckval"):
        # Where a training script imports it, at the top: rank 0 sets its reporter up
        # while training starts.
        import trainer_integration  # noqa: F401

    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train[rank::world])
    y = torch.from_numpy(y_train[rank::world]).long()
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batch_indices(len(x), BATCH_SIZE)

    def train_steps(n: int) -> float:
        model.train()
        loss = torch.tensor(0.0)
        for _ in range(n):
            idx = next(batches)
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
        return loss.item()

    timings: dict[str, Any] = {"report_blocked_s": [], "inline_validation_s": [], "train_s": []}
    if config["way"] == "calibrate":
        train_steps(config["warmup_steps"])
        started = time.perf_counter()
        train_steps(config["timed_steps"])
        timings["step_s"] = (time.perf_counter() - started) / config["timed_steps"]
    else:
        timings["loop_start"] = time.time()
        step = 0
        for index in range(config["checkpoints"]):
            started = time.perf_counter()
            loss = train_steps(config["steps_per_checkpoint"])
            timings["train_s"].append(time.perf_counter() - started)
            step += config["steps_per_checkpoint"]
            metrics = {"step": step, "checkpoint_index": index, "train_loss": loss}
            _report(config, rank, model, metrics, timings)
        timings["loop_end"] = time.time()
    Path(_rank_timings_path(config["timings_path"], rank)).write_text(json.dumps(timings))


def _rank_timings_path(path: str, rank: int) -> str:
    return path if rank == 0 else f"{path}.rank{rank}"


def _batch_indices(n: int, batch: int):
    """Endless deterministic mini-batches: a seeded permutation per epoch."""
    while True:
        order = torch.randperm(n)
        for start in range(0, n - batch + 1, batch):
            yield order[start : start + batch]


def _report(config: dict, rank: int, model: nn.Module, metrics: dict, timings: dict) -> None:
    """Reports one checkpoint the way under test; times how long rank 0 was blocked."""
    import ray.train

    way = config["way"]
    asynchronous = way in ("native", "ckval-async")
    mode = "ASYNC" if asynchronous else "SYNC"
    if rank != 0:
        started = time.perf_counter()
        if way.startswith("ckval"):
            from trainer_integration import report

            report({}, None)
        else:
            ray.train.report({}, None, checkpoint_upload_mode=ray.train.CheckpointUploadMode[mode])
        timings["report_blocked_s"].append(time.perf_counter() - started)
        return
    # ASYNC keeps the folder until the upload is done, and then deletes it (Ray's guide):
    # a folder of its own per report. SYNC may drop it when report() returns.
    directory = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        module = model.module if hasattr(model, "module") else model
        torch.save(module.state_dict(), os.path.join(directory, "model.pt"))
        if config.get("checkpoint_mb"):
            with open(os.path.join(directory, "padding.bin"), "wb") as f:
                f.write(os.urandom(int(config["checkpoint_mb"] * 2**20)))
        checkpoint = ray.train.Checkpoint.from_directory(directory)
        if way == "inline":
            validated = validate_checkpoint(checkpoint, **config["validate_kwargs"])
            timings["inline_validation_s"].append(validated["validation_time"])
            started = time.perf_counter()
            ray.train.report({**metrics, **validated}, checkpoint=checkpoint)
        elif way.startswith("native"):
            # validation=True (Ray 2.54+) or validate_fn=/validate_config= (2.51-2.53).
            native = native_validation(native_validate_fn, config["validate_kwargs"])
            started = time.perf_counter()
            ray.train.report(
                metrics,
                checkpoint=checkpoint,
                checkpoint_upload_mode=ray.train.CheckpointUploadMode[mode],
                **native.report_kwargs,
            )
        else:
            from trainer_integration import CheckpointUploadMode, report

            started = time.perf_counter()
            report(
                metrics,
                checkpoint,
                validate_fn=ckval_validate_fn,
                validate_config=config["validate_kwargs"],
                validation_resources={"num_cpus": 1},
                checkpoint_upload_mode=CheckpointUploadMode[mode],
            )
        timings["report_blocked_s"].append(time.perf_counter() - started)
    finally:
        if not asynchronous:
            shutil.rmtree(directory, ignore_errors=True)


# -------------------------------------------------------------------------------- runs
@dataclasses.dataclass
class Bench:
    """What every run shares: where files go, the calibrated workload, the service."""

    workdir: Path
    noisy_copies: int
    service: Any = None
    checkpoint_mb: float = 0.0  # padding added to each checkpoint (the model is ~20 KB)

    def trainer(self, way: str, run: str, config: dict, **kwargs):
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        config = {
            **config,
            "way": way,
            "seed": SEED,
            "timings_path": str(self.workdir / f"{run}.json"),
        }
        return TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=NUM_WORKERS),
            run_config=RunConfig(name=run, storage_path=str(self.workdir / "ray_results")),
            **kwargs,
        )

    def timings(self, run: str) -> dict:
        """Rank 0's timings, its report times replaced by how long each report held training.

        A report holds training for the longest time any rank spent in it; rank 0's
        in-loop validation (inline) is counted as in-loop validation, not as blocking.
        """
        path = self.workdir / f"{run}.json"
        timings = json.loads(path.read_text())
        inline = timings["inline_validation_s"] or [0.0] * len(timings["report_blocked_s"])
        held = [i + b for i, b in zip(inline, timings["report_blocked_s"], strict=True)]
        for rank in range(1, NUM_WORKERS):
            other = json.loads(Path(_rank_timings_path(str(path), rank)).read_text())
            held = [max(h, b) for h, b in zip(held, other["report_blocked_s"], strict=True)]
        timings["rank0_report_blocked_s"] = timings["report_blocked_s"]
        timings["report_blocked_s"] = [h - i for h, i in zip(held, inline, strict=True)]
        return timings


def run_inline(bench: Bench, scenario: str, checkpoints: int, steps: int) -> WayResult:
    run, config = _run_config(bench, "inline", scenario, checkpoints, steps)
    started = time.time()
    result = bench.trainer("inline", run, config).fit()
    return _ray_result(bench, run, scenario, "inline", checkpoints, steps, started, result)


def run_native(
    bench: Bench, scenario: str, checkpoints: int, steps: int, way: str = "native"
) -> WayResult:
    run, config = _run_config(bench, way, scenario, checkpoints, steps)
    native = native_validation(native_validate_fn, config["validate_kwargs"], {"num_cpus": 1})
    started = time.time()
    trainer = bench.trainer(way, run, config, **native.trainer_kwargs)
    result = trainer.fit()
    return _ray_result(bench, run, scenario, way, checkpoints, steps, started, result)


def run_ckval(
    bench: Bench, scenario: str, checkpoints: int, steps: int, way: str = "ckval"
) -> WayResult:
    from validation_service import Registry

    run, config = _run_config(bench, way, scenario, checkpoints, steps)
    started = time.time()
    bench.trainer(way, run, config).fit()
    registry = Registry()
    registry.wait(run, timeout_s=600)
    ended = time.time()
    timings = bench.timings(run)
    records = registry.checkpoints(run)
    validated = [r.metrics for r in records if r.validation_status == "VALIDATED"]
    # Available to every process once committed: the registry's finish time, not the
    # validate_fn's.
    jobs = [j for j in registry.validations(run) if j.finished_at is not None]
    available = max((j.finished_at.timestamp() for j in jobs), default=ended)
    result = way_result(
        scenario, way, checkpoints, steps, started, ended, timings, validated, available
    )
    result.detail = ckval_latency(registry.validations(run))
    return result


def _run_config(bench: Bench, way: str, scenario: str, checkpoints: int, steps: int):
    run = f"bench-{way}-{scenario}-{checkpoints}-{uuid.uuid4().hex[:6]}"
    config = {
        "checkpoints": checkpoints,
        "steps_per_checkpoint": steps,
        "validate_kwargs": {"noisy_copies": bench.noisy_copies},
        "checkpoint_mb": bench.checkpoint_mb,
    }
    return run, config


def _ray_result(bench, run, scenario, way, checkpoints, steps, started, result) -> WayResult:
    ended = time.time()
    validated = [m for _, m in result.best_checkpoints if "validation_time" in m]
    return way_result(
        scenario, way, checkpoints, steps, started, ended, bench.timings(run), validated
    )


RUNNERS = {
    "inline": run_inline,
    "native": run_native,
    "native-sync": lambda *args: run_native(*args, way="native-sync"),
    "ckval": run_ckval,
    "ckval-async": lambda *args: run_ckval(*args, way="ckval-async"),
}


# ------------------------------------------------------------------------- calibration
def calibrate_noisy_copies(target_s: float, workdir: Path) -> int:
    """Noisy copies that make validate_checkpoint cost about target_s on one thread."""
    from ray.train import Checkpoint

    torch.manual_seed(SEED)
    directory = workdir / "calibration-checkpoint"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(make_model().state_dict(), directory / "model.pt")
    checkpoint = Checkpoint.from_directory(str(directory))

    def cost(copies: int) -> float:
        return min(
            validate_checkpoint(checkpoint, noisy_copies=copies)["validation_time"]
            for _ in range(3)
        )

    small, large = 20, 200
    fixed_and_small, fixed_and_large = cost(small), cost(large)
    per_copy = max((fixed_and_large - fixed_and_small) / (large - small), 1e-6)
    fixed = max(fixed_and_small - small * per_copy, 0.0)
    return max(1, round((target_s - fixed) / per_copy))


def calibrate_step_seconds(bench: Bench) -> float:
    """Seconds per training step of the real 2-worker TorchTrainer loop."""
    run = f"bench-calibrate-{uuid.uuid4().hex[:6]}"
    config = {"warmup_steps": 20, "timed_steps": 300}
    bench.trainer("calibrate", run, config).fit()
    return bench.timings(run)["step_s"]


# -------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    wall_started = time.perf_counter()
    load_before = load_average()
    workdir = fresh_ckval_home("ckval-bench-async-")
    if args.smoke:
        # Ray Train's controller looks at the workers every 2 s: each report waits for that
        # look, and so does the end of each run. The smoke test measures nothing, so its
        # runs poll every 0.1 s; measured runs keep Ray's default.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    if __name__ != "__main__":  # imported: ship this module's functions by value
        pickle_by_value(__name__)

    import ray

    from validation_service import ValidationService
    from validation_service.config import ckval_env

    noisy_copies = args.noisy_copies or calibrate_noisy_copies(args.validation_seconds, workdir)
    print(f"validation: {noisy_copies} noisy copies ~ {args.validation_seconds:g} s")
    ray_cpus = NUM_WORKERS + max(args.ckval_concurrency, 1)
    ray.init(
        num_cpus=ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    bench = Bench(workdir=workdir, noisy_copies=noisy_copies)
    results: list[WayResult] = []
    try:
        if "ckval" in args.ways:
            bench.service = ValidationService.start(
                pools={"CPU": args.ckval_concurrency},
                default_pool_size=args.ckval_concurrency,
            )
        step_s = SMOKE_STEP_S if args.smoke else calibrate_step_seconds(bench)
        print(f"training: {step_s * 1000:.2f} ms per step")
        if args.warmup:
            # One short untimed run per way: Ray's workers exist and have imported torch
            # and torchmetrics before anything is measured (a long-running service's
            # steady state). Cold starts are in the first run of a --no-warmup run.
            for way in args.ways:
                bench.checkpoint_mb = 0.0
                print(f"warm-up: {way} (2 checkpoints, not measured) ...", flush=True)
                RUNNERS[way](bench, "warmup", 2, max(1, round(0.5 / step_s)))
        scenarios = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
        for scenario in scenarios:
            interval_s = SCENARIOS[scenario] * args.validation_seconds
            steps = args.steps_per_checkpoint or max(1, round(interval_s / step_s))
            for checkpoints, checkpoint_mb in [
                (n, mb) for n in args.checkpoints for mb in args.checkpoint_mb
            ]:
                bench.checkpoint_mb = checkpoint_mb
                runs: dict[str, list[WayResult]] = {way: [] for way in args.ways}
                for repeat in range(args.repeats):
                    # Rotate the order so no way always runs first (cold workers, load drift).
                    for way in args.ways[repeat:] + args.ways[:repeat]:
                        print(
                            f"[{scenario}] {checkpoints} checkpoints of +{checkpoint_mb:g} MB x "
                            f"{steps} steps: {way} "
                            f"(run {repeat + 1}/{args.repeats}) ...",
                            flush=True,
                        )
                        result = RUNNERS[way](bench, scenario, checkpoints, steps)
                        result.checkpoint_mb = checkpoint_mb
                        runs[way].append(result)
                        print(
                            f"  e2e {result.e2e_s:.2f}s, final wait {result.final_wait_s:.2f}s "
                            f"(until fit() {result.until_fit_s:.2f}s), "
                            f"blocked {result.report_blocked_s:.3f}s, best accuracy "
                            f"{result.best_accuracy:.4f}, load {result.load_1min:.1f}",
                            flush=True,
                        )
                        if result.detail:
                            print(f"  {result.detail}", flush=True)
                results += [median_result(runs[way]) for way in args.ways]
    finally:
        if bench.service is not None:
            bench.service.stop()
        ray.shutdown()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta = {
        **run_description(load_before),
        "noisy_copies": noisy_copies,
        "validation_seconds": args.validation_seconds,
        "step_ms": step_s * 1000,
        "workers": NUM_WORKERS,
        "lr": LR,
        "batch_size": BATCH_SIZE,
        "seed": SEED,
        "ckval_concurrency": args.ckval_concurrency,
        "ray_cpus": ray_cpus,
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - wall_started,
        "warmup": args.warmup,
    }
    markdown = render_markdown(results, meta)
    print("\n" + markdown)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown + "\n")
    problems = check_results(results, args.score_tolerance)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
