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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description
from torch import nn

from validation_service._ray_compat import native_validation
from validation_service.demo import load_digits_split, make_model

WAYS = ("inline", "native", "native-sync", "ckval", "ckval-async")
# ckval's ways and the native way each is held against: Ray's guide calls ASYNC.
COMPARED = {"ckval": "native", "ckval-async": "native"}
SCENARIOS = {"backlog": 0.5, "no-backlog": 3.0}  # checkpoint interval / validation time
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
class WayResult:
    scenario: str
    way: str
    checkpoints: int
    steps_per_checkpoint: int
    e2e_s: float
    report_blocked_s: float
    inline_validation_s: float
    final_wait_s: float
    until_fit_s: float
    total_validation_s: float
    validations: int
    best_accuracy: float
    mean_train_interval_s: float
    first_report_blocked_s: float = 0.0
    later_report_median_s: float = 0.0  # the median report() after the first
    load_1min: float = 0.0  # the machine's 1-minute load average when the run ended
    checkpoint_mb: float = 0.0
    runs: int = 1
    detail: str = ""

    @property
    def blocked_per_report_s(self) -> float:
        return self.report_blocked_s / max(self.checkpoints, 1)

    @property
    def blocking_s(self) -> float:
        """Time the run was held up by validation (Ray's release-test definition)."""
        return self.report_blocked_s + self.inline_validation_s + self.final_wait_s


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
    result = _way_result(
        scenario, way, checkpoints, steps, started, ended, timings, validated, available
    )
    result.detail = ckval_latency(registry.validations(run))
    return result


def ckval_latency(jobs) -> str:
    """Where ckval's validation time went, per job: queued, task start, attempt running."""

    def mean(deltas) -> float:
        seconds = [d.total_seconds() for d in deltas]
        return sum(seconds) / max(len(seconds), 1)

    for job in jobs:
        if job.status != "SUCCEEDED":
            print(f"  ckval job {job.report_index}: {job.status} {job.error_message}")
    done = [(job, job.attempt_history[-1]) for job in jobs if job.status == "SUCCEEDED"]
    done = [(j, a) for j, a in done if a.started_at and a.finished_at and j.finished_at]
    if not done:
        return ""
    return (
        f"ckval per job (mean s): queued {mean(a.claimed_at - j.created_at for j, a in done):.2f}"
        f", task start {mean(a.started_at - a.claimed_at for j, a in done):.2f}"
        f", attempt running {mean(a.finished_at - a.started_at for j, a in done):.2f}"
        f", recorded {mean(j.finished_at - a.finished_at for j, a in done):.2f}"
        f"; {len({a.worker_pid for _, a in done})} worker process(es)"
    )


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
    return _way_result(
        scenario, way, checkpoints, steps, started, ended, bench.timings(run), validated
    )


def _way_result(
    scenario, way, checkpoints, steps, started, ended, timings, validated, available=None
):
    if available is None:  # when the last validate_fn returned
        available = max((m["finished_at"] for m in validated), default=ended)
    return WayResult(
        scenario=scenario,
        way=way,
        checkpoints=checkpoints,
        steps_per_checkpoint=steps,
        e2e_s=ended - started,
        report_blocked_s=sum(timings["report_blocked_s"]),
        inline_validation_s=sum(timings["inline_validation_s"]),
        final_wait_s=max(0.0, available - timings["loop_end"]),
        until_fit_s=ended - timings["loop_end"],
        total_validation_s=sum(m["validation_time"] for m in validated),
        validations=len(validated),
        best_accuracy=max((m["accuracy"] for m in validated), default=float("nan")),
        mean_train_interval_s=sum(timings["train_s"]) / max(len(timings["train_s"]), 1),
        first_report_blocked_s=timings["report_blocked_s"][0] if timings["report_blocked_s"] else 0,
        later_report_median_s=statistics.median(timings["report_blocked_s"][1:] or [0.0]),
        load_1min=os.getloadavg()[0],
    )


def median_result(runs: list[WayResult]) -> WayResult:
    """One row for repeated runs of a way: the median of every measured number."""
    if len(runs) == 1:
        return runs[0]
    numbers = {
        f.name: statistics.median(getattr(r, f.name) for r in runs)
        for f in dataclasses.fields(WayResult)
        if f.type in ("float", float)
    }
    details = "; ".join(f"run {i + 1}: {r.detail}" for i, r in enumerate(runs) if r.detail)
    return dataclasses.replace(
        runs[0],
        **numbers,
        validations=min(r.validations for r in runs),
        runs=len(runs),
        detail=details,
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


# ----------------------------------------------------------------------------- output
def render_markdown(results: list[WayResult], meta: dict[str, Any]) -> str:
    lines = [
        "# Async validation: inline vs Ray Train native vs ckval",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- versions: {meta['versions']}",
        f"- load average (1/5/15 min) before: {meta['load_before']}, after: {meta['load_after']}",
        f"- workload: MLP 64-64-10 on sklearn digits, TorchTrainer with {NUM_WORKERS} "
        f"workers, SGD lr {LR}, batch {BATCH_SIZE}, seed {SEED}; one validation = "
        f"held-out accuracy + accuracy over {meta['noisy_copies']} noised copies of the "
        f"held-out set (torchmetrics), calibrated to ~{meta['validation_seconds']:g} s "
        f"on the driver; {meta['step_ms']:.2f} ms per training step (calibrated)",
        f"- ckval: service pool concurrency {meta['ckval_concurrency']}; native: Ray's "
        "MAX_IN_FLIGHT_VALIDATIONS = 1; both 1 CPU per validation; Ray logical CPUs "
        f"{meta['ray_cpus']}",
        f"- wall time of the whole script: {meta['wall_s']:.0f} s",
        "- warm-up: "
        + (
            "one untimed 2-checkpoint run per way before the measured runs"
            if meta["warmup"]
            else "none (the first run of each way starts cold)"
        ),
        "",
        "Columns: e2e = fit() start until the driver holds every validated metric; report "
        "blocked = sum over reports of the longest time a rank was blocked in report(); in-loop "
        "val = validation inside the"
        " loop (inline only); final wait = training loop end until the last validated metric is"
        " available (native: its last validation task returned, in the controller; ckval: "
        "committed to the registry; inline: 0); until fit() = training loop end until fit() "
        "returned and the driver holds every validated metric (includes Ray Train's shutdown of"
        " the run); blocking = report blocked + in-loop val + final wait; validation = sum of "
        "validate_fn durations; interval = mean training time between checkpoints; first report"
        " = how long the first report() blocked (it includes one-time set-up: Ray Train's own,"
        " and for ckval pickling validate_fn); later reports = the median time one report() after"
        " the first blocked; load = the machine's 1-minute load average at"
        " the end of the run (above 2 on 2 cores means other processes competed for the CPUs)."
        + (f" Medians of {meta['repeats']} runs per row." if meta["repeats"] > 1 else ""),
        "",
    ]
    for scenario in dict.fromkeys(r.scenario for r in results):
        rows = [r for r in results if r.scenario == scenario]
        lines += [
            f"## Scenario `{scenario}` ({SCENARIOS[scenario]:g}x the validation time "
            "between checkpoints)",
            "",
            "| checkpoints | ckpt MB | K steps | way | e2e (s) | report blocked (s) "
            "| per report (ms) | first report (s) "
            "| later reports, median (ms) | in-loop val (s) | final wait (s) | until fit() (s) "
            "| blocking (s) | validation (s) | validated | interval (s) | best accuracy | load |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r.checkpoints} | {r.checkpoint_mb:g} | {r.steps_per_checkpoint} | {r.way} "
                f"| {r.e2e_s:.2f} | {r.report_blocked_s:.3f} "
                f"| {1000 * r.blocked_per_report_s:.1f} | {r.first_report_blocked_s:.3f} "
                f"| {1000 * r.later_report_median_s:.1f} "
                f"| {r.inline_validation_s:.2f} "
                f"| {r.final_wait_s:.2f} | {r.until_fit_s:.2f} | {r.blocking_s:.2f} "
                f"| {r.total_validation_s:.2f} "
                f"| {r.validations}/{r.checkpoints} | {r.mean_train_interval_s:.2f} "
                f"| {r.best_accuracy:.4f} | {r.load_1min:.1f} |"
            )
        details = [f"- {r.checkpoints} checkpoints, {r.way}: {r.detail}" for r in rows if r.detail]
        lines += ["", *ratio_table(rows), "", *details, ""]
    return "\n".join(lines)


def ratio_table(rows: list[WayResult]) -> list[str]:
    lines = [
        "ckval / native in the same run (below 1 is better for ckval); native is Ray's "
        "ASYNC call, as in its guide:",
        "",
        "| checkpoints | ckpt MB | ckval way | e2e | report blocked | later reports "
        "| final wait | until fit() | blocking | final wait native (s) | final wait ckval (s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, mb in dict.fromkeys((r.checkpoints, r.checkpoint_mb) for r in rows):
        by_way = {r.way: r for r in rows if (r.checkpoints, r.checkpoint_mb) == (n, mb)}
        for way, against in COMPARED.items():
            ckval, native = by_way.get(way), by_way.get(against)
            if native is None or ckval is None:
                continue
            lines.append(
                f"| {n} | {mb:g} | {way} | {_ratio(ckval.e2e_s, native.e2e_s)} "
                f"| {_ratio(ckval.report_blocked_s, native.report_blocked_s)} "
                f"| {_ratio(ckval.later_report_median_s, native.later_report_median_s)} "
                f"| {_ratio(ckval.final_wait_s, native.final_wait_s)} "
                f"| {_ratio(ckval.until_fit_s, native.until_fit_s)} "
                f"| {_ratio(ckval.blocking_s, native.blocking_s)} "
                f"| {native.final_wait_s:.2f} | {ckval.final_wait_s:.2f} |"
            )
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def check_results(results: list[WayResult], tolerance: float) -> list[str]:
    """Problems that make the comparison invalid: missing validations, differing scores."""
    problems = []
    for r in results:
        if r.validations != r.checkpoints:
            problems.append(
                f"{r.scenario}/{r.checkpoints}/{r.way}: {r.validations} of "
                f"{r.checkpoints} checkpoints validated"
            )
    groups: dict[tuple, list[WayResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.checkpoints, r.checkpoint_mb), []).append(r)
    for (scenario, n, _), rows in groups.items():
        scores = [r.best_accuracy for r in rows]
        if max(scores) - min(scores) > tolerance:
            detail = ", ".join(f"{r.way}={r.best_accuracy:.4f}" for r in rows)
            problems.append(
                f"{scenario}/{n}: best accuracy differs by more than {tolerance}: {detail}"
            )
    return problems


# -------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny run for CI: 2 checkpoints, ~0.3 s validations, backlog",
    )
    parser.add_argument(
        "--checkpoints",
        type=int,
        nargs="+",
        default=[4, 8, 16],
        help="numbers of checkpoints to sweep (default: 4 8 16)",
    )
    parser.add_argument(
        "--validation-seconds",
        type=float,
        default=1.0,
        help="target cost of one validation (default: 1.0)",
    )
    parser.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="backlog")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument(
        "--steps-per-checkpoint",
        type=int,
        default=None,
        help="fix K instead of calibrating it from the scenario",
    )
    parser.add_argument(
        "--noisy-copies",
        type=int,
        default=None,
        help="fix the validation cost instead of calibrating it",
    )
    parser.add_argument("--ckval-concurrency", type=int, default=2)
    parser.add_argument(
        "--checkpoint-mb",
        type=float,
        nargs="+",
        default=[0.0],
        help="pad each checkpoint with this many MB of random bytes; several sweep (default 0)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per way and checkpoint count; the tables show medians (default 1)",
    )
    parser.add_argument(
        "--score-tolerance",
        type=float,
        default=0.01,
        help="allowed spread of best accuracy across ways (default 0.01)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="measure from a cold start (by default one untimed run per way goes first)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary CKVAL_HOME")
    args = parser.parse_args(argv)
    if args.smoke:
        args.checkpoints, args.validation_seconds, args.scenario = [2], 0.3, "backlog"
        args.warmup = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
