"""Validation throughput of the three executors (plain Ray task validate_fn,
MapBatchesValidator, TorchTrainerValidator) on the same checkpoint and data, CPU only:
checkpoints validated per minute.

One MLP checkpoint (``validation_service.cli.demo.make_model``) is trained briefly on the
driver on scikit-learn's digits and saved as ``model.pt``. For each executor, in turn,
N copies of it are reported with ``trainer_integration.Client(run).report(...)`` to the
ckval service (embedded default: local Ray, SQLite and a local folder under a fresh
temporary CKVAL_HOME), and the driver waits with ``Registry().wait(run)``. Every
executor scores the same held-out digits (25% of the set, 450 rows):

- ``ray task``: ``validation_service.cli.demo.validate_digits``, a plain validate_fn that
  computes accuracy with torchmetrics, in one Ray task with 1 CPU;
- ``MapBatchesValidator``: a predictor class over a ``ray.data`` Dataset of the held-out
  rows (``--map-batches-actors`` actors of 1 CPU), its "correct" column averaged;
- ``TorchTrainerValidator``: an eval-only TorchTrainer with ``--trainer-workers``
  workers, torchmetrics accuracy reduced across the workers (gloo).

The two validators are reported with ``validation_resources=validator.recommended_resources``
(the driving task takes no CPU). The service runs ``--pool-size`` validations at once
(its CPU pool); Ray gets ``--ray-cpus`` logical CPUs, more than the machine's cores, so
that trainer workers and map_batches actors can be scheduled next to each other.
Before the measured runs, ``--pool-size`` ray-task validations warm up Ray's worker
pool (not counted); the validators start fresh actors for every validation anyway.

Measured per executor, from the registry:

- validated/min: validated checkpoints / (first job created, i.e. the first report,
  -> last job finished), times 60;
- median validation: the attempt's started -> finished, as the worker recorded it
  (loading the checkpoint and the validate_fn, not the queueing);
- accuracy: what the executor computed; every executor and every copy must agree with
  the accuracy computed on the driver (numpy argmax), else the script exits 1.

Reproduce benchmarks/results/executors.md::

    .venv/bin/python benchmarks/bench_executors.py --out benchmarks/results/executors.md

Smoke test (CI, a few minutes: 2 checkpoints per executor, 1 for TorchTrainer)::

    .venv/bin/python benchmarks/bench_executors.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description
from torch import nn

from validation_service.cli.demo import load_digits_split, make_model, validate_digits

EXECUTORS = ("ray-task", "map-batches", "torch-trainer")
SEED = 0
LR = 0.1
TRAIN_BATCH_SIZE = 32
ACCURACY_TOLERANCE = 1e-6


# ------------------------------------------------------------------ checkpoint and data
def train_checkpoint(directory: Path, epochs: int) -> Path:
    """The one checkpoint every executor validates: the demo's MLP after a few epochs."""
    torch.manual_seed(SEED)
    x_train, _, y_train, _ = load_digits_split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train).long()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for start in range(0, len(x), TRAIN_BATCH_SIZE):
            idx = order[start : start + TRAIN_BATCH_SIZE]
            optimizer.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            optimizer.step()
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / "model.pt")
    return directory


def load_model(checkpoint) -> nn.Module:
    model = make_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), map_location="cpu"))
    return model.eval()


def reference_accuracy(checkpoint_dir: Path) -> float:
    """Accuracy on the held-out digits computed here, without torchmetrics or Ray."""
    from ray.train import Checkpoint

    _, x_val, _, y_val = load_digits_split()
    model = load_model(Checkpoint.from_directory(str(checkpoint_dir)))
    with torch.no_grad():
        logits = model(torch.from_numpy(x_val)).numpy()
    return float(np.mean(np.argmax(logits, axis=1) == y_val))


def heldout_rows() -> list[dict[str, Any]]:
    _, x_val, _, y_val = load_digits_split()
    return [{"x": x, "y": int(y)} for x, y in zip(x_val, y_val, strict=True)]


# ------------------------------------------------------------------- validation code
class DigitsPredictor:
    """The map_batches predictor: one 0/1 "correct" per row (averaged into "accuracy")."""

    def __init__(self, checkpoint):
        torch.set_num_threads(1)
        self.model = load_model(checkpoint)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        labels = torch.as_tensor(batch["y"])
        with torch.no_grad():
            logits = self.model(torch.as_tensor(batch["x"], dtype=torch.float32))
        return {"correct": (logits.argmax(dim=1) == labels).numpy().astype(np.int64)}


def digits_eval_loop(config: dict[str, Any]) -> dict[str, float]:
    """The eval-only Ray Train loop: torchmetrics accuracy synced across the workers.

    Returns (rank 0's value is the validation's result) the accuracy and the time the
    loop itself took, so that the Ray Train start-up shows as the rest of the attempt.
    """
    import ray.train
    import torchmetrics

    started = time.perf_counter()
    torch.set_num_threads(1)
    model = load_model(config["checkpoint"])
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    shard = ray.train.get_dataset_shard("validation")
    with torch.no_grad():
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
            accuracy.update(model(batch["x"].float()), batch["y"])
    value = accuracy.compute().item()  # all-reduces the counts over the process group
    return {"accuracy": value, "eval_loop_s": time.perf_counter() - started}


@dataclasses.dataclass
class ExecutorCase:
    """One executor under test: what report() gets for it, and how many copies."""

    key: str
    name: str
    validate_fn: Callable[..., dict]
    validate_config: dict[str, Any] | None
    resources: dict[str, Any]
    checkpoints: int


def executor_cases(args: argparse.Namespace) -> dict[str, ExecutorCase]:
    import ray.data
    from ray.train import ScalingConfig

    from validation_service.executors.map_batches import MapBatchesValidator
    from validation_service.executors.torch_trainer import TorchTrainerValidator

    # In memory: a copy of its rows travels inside each stored validate_fn.
    dataset = ray.data.from_items(heldout_rows(), override_num_blocks=4)
    map_batches = MapBatchesValidator(
        DigitsPredictor,
        dataset,
        batch_size=args.batch_size,
        concurrency=args.map_batches_actors,
        num_cpus=1,
    )
    trainer = TorchTrainerValidator(
        digits_eval_loop,
        scaling_config=ScalingConfig(num_workers=args.trainer_workers),
        datasets={"validation": dataset},
        eval_config={"batch_size": args.batch_size},
    )
    return {
        "ray-task": ExecutorCase(
            "ray-task",
            "ray task",
            validate_digits,
            {"batch_size": args.batch_size},
            {"num_cpus": 1},
            args.checkpoints,
        ),
        "map-batches": ExecutorCase(
            "map-batches",
            "MapBatchesValidator",
            map_batches,
            None,
            map_batches.recommended_resources,
            args.checkpoints,
        ),
        "torch-trainer": ExecutorCase(
            "torch-trainer",
            "TorchTrainerValidator",
            trainer,
            None,
            trainer.recommended_resources,
            args.checkpoints_trainer,
        ),
    }


# ------------------------------------------------------------------------ measurement
@dataclasses.dataclass
class ExecutorResult:
    name: str
    checkpoints: int
    validated: int
    span_s: float
    reporting_s: float
    validation_s: list[float]
    accuracies: list[float]
    first_start_s: float
    eval_loop_s: list[float]
    failures: list[str]

    @property
    def per_minute(self) -> float:
        return 60.0 * self.validated / self.span_s if self.span_s > 0 else float("nan")

    @property
    def median_validation_s(self) -> float:
        return statistics.median(self.validation_s) if self.validation_s else float("nan")


def measure(
    case: ExecutorCase, checkpoint_dir: Path, registry, run: str, timeout_s: float
) -> ExecutorResult:
    """Reports case.checkpoints copies of the checkpoint, waits, reads the registry."""
    from ray.train import Checkpoint

    from trainer_integration import Client
    from validation_service import JobStatus

    client = Client(run)
    for copy in range(case.checkpoints):
        client.report(
            {"copy": copy},
            Checkpoint.from_directory(str(checkpoint_dir)),
            validate_fn=case.validate_fn,
            validate_config=case.validate_config,
            validation_resources=case.resources,
            max_attempts=1,  # a failure shows as one, not as a slower retried validation
        )
    registry.wait(run, timeout_s=timeout_s)
    jobs = registry.validations(run)
    succeeded = [job for job in jobs if job.status == JobStatus.SUCCEEDED.value]
    first_report = min(job.created_at for job in jobs)
    last_finished = max(job.finished_at for job in jobs)
    attempts = [
        attempt
        for job in succeeded
        for attempt in job.attempt_history
        if attempt.status == JobStatus.SUCCEEDED.value
    ]
    first_start = min((a.started_at for a in attempts), default=last_finished)
    return ExecutorResult(
        name=case.name,
        checkpoints=case.checkpoints,
        validated=len(succeeded),
        span_s=_seconds(last_finished - first_report),
        reporting_s=_seconds(max(job.created_at for job in jobs) - first_report),
        validation_s=[_seconds(a.finished_at - a.started_at) for a in attempts],
        accuracies=[job.result_metrics["accuracy"] for job in succeeded],
        first_start_s=_seconds(first_start - first_report),
        eval_loop_s=[
            job.result_metrics["eval_loop_s"]
            for job in succeeded
            if "eval_loop_s" in job.result_metrics
        ],
        failures=[
            f"report {job.report_index}: {job.status} {job.error_type}: {job.error_message}"
            for job in jobs
            if job.status != JobStatus.SUCCEEDED.value
        ],
    )


def check_results(results: list[ExecutorResult], reference: float) -> list[str]:
    """Problems that make the comparison invalid: failed validations, differing scores."""
    problems = []
    for r in results:
        if r.validated != r.checkpoints:
            problems.append(f"{r.name}: {r.validated} of {r.checkpoints} checkpoints validated")
        problems += [f"{r.name}: {failure}" for failure in r.failures]
        wrong = sorted({a for a in r.accuracies if abs(a - reference) > ACCURACY_TOLERANCE})
        if wrong:
            problems.append(
                f"ACCURACY MISMATCH: {r.name} computed {wrong} for the checkpoint whose "
                f"accuracy on the driver is {reference:.6f}"
            )
    return problems


# ----------------------------------------------------------------------------- output
def render_markdown(
    results: list[ExecutorResult], meta: dict[str, Any], problems: list[str]
) -> str:
    lines = [
        "# Validation throughput of the three executors",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- versions: {meta['versions']}",
        f"- load average (1/5/15 min) before: {meta['load_before']}, after: {meta['load_after']}",
        f"- service: CPU pool {meta['pool_size']} concurrent validations; Ray logical CPUs "
        f"{meta['ray_cpus']}; map_batches: {meta['map_batches_actors']} actor(s) of 1 CPU; "
        f"TorchTrainer: {meta['trainer_workers']} worker(s) of 1 CPU; batch size "
        f"{meta['batch_size']}",
        f"- checkpoint: MLP 64-{meta['hidden']}-10 trained {meta['train_epochs']} epochs on "
        f"the driver, reported as copies; held-out digits: {meta['rows']} rows; accuracy "
        f"on the driver {meta['reference']:.4f}",
        f"- wall time of the whole script: {meta['wall_s']:.0f} s",
        "",
        "validated/min = validated checkpoints / (first report -> last job finished, from "
        "the registry's job timestamps) x 60; median validation = the attempt's started -> "
        "finished in the worker (checkpoint load + validate_fn, no queueing).",
        "",
        "| executor | checkpoints | validated/min | median validation s | accuracy |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.validated}/{r.checkpoints} | {r.per_minute:.1f} "
            f"| {r.median_validation_s:.2f} | {_accuracy_cell(r.accuracies)} |"
        )
    lines += ["", "Details:", ""]
    for r in results:
        busy = sum(r.validation_s)
        detail = (
            f"- {r.name}: {r.span_s:.1f} s from the first report to the last finished job, "
            f"of which {r.reporting_s:.2f} s reporting the copies one after another; "
            f"first validation started {r.first_start_s:.2f} s after the first report; "
            f"validations min/max {min(r.validation_s, default=float('nan')):.2f}/"
            f"{max(r.validation_s, default=float('nan')):.2f} s; mean validations in "
            f"flight {busy / r.span_s if r.span_s > 0 else float('nan'):.2f}"
        )
        if r.eval_loop_s:
            detail += (
                f"; median time inside the eval loop (rank 0) "
                f"{statistics.median(r.eval_loop_s):.2f} s of the "
                f"{r.median_validation_s:.2f} s validation"
            )
        lines.append(detail)
    lines.append("")
    if problems:
        lines += [f"- PROBLEM: {problem}" for problem in problems]
    else:
        lines.append(
            f"Accuracy check: every executor, on every copy, computed {meta['reference']:.6f}, "
            "the driver's accuracy."
        )
    return "\n".join(lines)


def _accuracy_cell(accuracies: list[float]) -> str:
    if not accuracies:
        return "-"
    low, high = min(accuracies), max(accuracies)
    return f"{low:.4f}" if high - low <= ACCURACY_TOLERANCE else f"{low:.4f}..{high:.4f} (!)"


# -------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=12,
        help="copies reported to the ray task and MapBatchesValidator (default 12)",
    )
    parser.add_argument(
        "--checkpoints-trainer",
        type=int,
        default=4,
        help="copies reported to TorchTrainerValidator (default 4: each is a Ray Train run)",
    )
    parser.add_argument(
        "--executors", nargs="+", choices=EXECUTORS, default=list(EXECUTORS), help="which to run"
    )
    parser.add_argument(
        "--pool-size", type=int, default=2, help="service CPU pool: concurrent validations"
    )
    parser.add_argument("--ray-cpus", type=int, default=8, help="Ray logical CPUs (default 8)")
    parser.add_argument("--trainer-workers", type=int, default=2)
    parser.add_argument("--map-batches-actors", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--train-epochs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=1800, help="wait per executor")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up validation")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary CKVAL_HOME")
    args = parser.parse_args(argv)
    if args.smoke:
        # Measures nothing: no warm-up validation, and Ray Train's controller looks at the
        # TorchTrainerValidator's workers every 0.1 s instead of 2 s.
        args.checkpoints, args.checkpoints_trainer, args.train_epochs = 2, 1, 2
        args.no_warmup = True
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    if min(args.checkpoints, args.checkpoints_trainer, args.pool_size) < 1:
        parser.error("--checkpoints, --checkpoints-trainer and --pool-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall_started = time.perf_counter()
    load_before = load_average()
    workdir = fresh_ckval_home("ckval-bench-executors-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if __name__ != "__main__":  # imported: ship this module's functions by value
        pickle_by_value(__name__)

    import ray

    from validation_service import Registry, ValidationService
    from validation_service.cli.demo import HIDDEN
    from validation_service.config import ckval_env

    checkpoint_dir = train_checkpoint(workdir / "checkpoint", args.train_epochs)
    reference = reference_accuracy(checkpoint_dir)
    print(f"checkpoint trained {args.train_epochs} epochs: accuracy {reference:.4f} on the driver")
    ray.init(
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = None
    results: list[ExecutorResult] = []
    try:
        service = ValidationService.start(pools={"CPU": args.pool_size})
        registry = Registry()
        cases = executor_cases(args)
        if not args.no_warmup:
            # One validation per pool slot: starts as many pooled Ray workers as run at
            # once and imports torch in them, so the ray task row is not a cold start.
            warmup = dataclasses.replace(cases["ray-task"], checkpoints=args.pool_size)
            measure(warmup, checkpoint_dir, registry, _run_name("warmup"), args.timeout_s)
        for case in (cases[key] for key in args.executors):
            print(f"{case.name}: {case.checkpoints} checkpoints ...", flush=True)
            result = measure(case, checkpoint_dir, registry, _run_name(case.key), args.timeout_s)
            results.append(result)
            print(
                f"  {result.validated}/{result.checkpoints} validated in {result.span_s:.1f} s: "
                f"{result.per_minute:.1f}/min, median validation "
                f"{result.median_validation_s:.2f} s, accuracy "
                f"{_accuracy_cell(result.accuracies)}, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        if service is not None:
            service.stop()
        ray.shutdown()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta = {
        **run_description(load_before),
        "pool_size": args.pool_size,
        "ray_cpus": args.ray_cpus,
        "map_batches_actors": args.map_batches_actors,
        "trainer_workers": args.trainer_workers,
        "batch_size": args.batch_size,
        "hidden": HIDDEN,
        "train_epochs": args.train_epochs,
        "rows": len(heldout_rows()),
        "reference": reference,
        "wall_s": time.perf_counter() - wall_started,
    }
    problems = check_results(results, reference)
    markdown = render_markdown(results, meta, problems)
    print("\n" + markdown)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown + "\n")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _run_name(what: str) -> str:
    return f"bench-executors-{what}-{uuid.uuid4().hex[:6]}"


def _seconds(delta: dt.timedelta) -> float:
    return delta.total_seconds()


if __name__ == "__main__":
    sys.exit(main())
