"""Early stopping on validated metrics (issue 28): how long a stop decision takes to reach
the training loop, and how much training a stop policy saves.

Both parts run a TorchTrainer with 2 workers on the digits MLP of the demo (the digits ship
with scikit-learn), report through ``trainer_integration.report(..., validate_fn=...)``
(ckval's default SYNC mode) and ask ``trainer_integration.should_stop()`` on every rank
after every report.

**lag**: the time from a stop decision to the loop's first ``should_stop()`` that returns
True. Between reports every rank trains as many real SGD steps as took ``--interval``
seconds at the start (the report interval; the table gives the measured one too). The
validation computes the accuracy of the checkpoint and a ``target_hit`` value that is 1
on every ``period``-th checkpoint and 0 otherwise; the run's policy is
``StopPolicy("target_hit", threshold=1)``, so a decision is due on each of those
checkpoints. When rank 0's ``should_stop()`` returns True it notes the time, reads
``registry.stop_decision(run)`` and calls ``registry.resume_despite_stop(run)``, so the
next round can decide: one run measures ``--decisions`` decisions. Per decision:

- decision -> seen: the decision row's ``decided_at`` (the service judges the policy
  right after the job is SUCCEEDED) to the return of the first True;
- job finished -> seen: the deciding job's ``finished_at`` to the same moment;
- report -> seen: the deciding checkpoint's ``report()`` call to the same moment, which
  adds the validation itself.

``trainer_integration`` is imported where the train function starts (``top``: what a
module-level import amounts to on a Ray Train worker) or just before the first report
(``inside``, as Ray's guides write it).

**saved**: the same run twice in one Ray session, ``--epochs`` epochs of
``--steps-per-epoch`` SGD steps each: once with ``StopPolicy("accuracy", patience=...,
min_delta=...)`` on the validated accuracy of the held-out digits, once with no policy
(trained to the end). Per run: epochs trained, the time in the training loop (longest
rank), ``fit()``'s wall time, and the worker time (loop wall time and process CPU time
summed over the ranks).

Two clusters, as the other benchmarks: ``fresh`` runs each lag measurement in a new
process that calls ``ray.init()`` (ckval's service starts with the run), ``long-lived``
runs the lag measurements and the saved-time pairs in one Ray with the service up.

    .venv/bin/python benchmarks/bench_early_stopping.py --out benchmarks/results/early_stopping.md

Smoke test (CI)::

    .venv/bin/python benchmarks/bench_early_stopping.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description
from bench_async_validation import _batch_indices, validate_checkpoint
from torch import nn

from validation_service.cli.demo import load_digits_split, make_model

NUM_WORKERS = 2
IMPORTS = ("top", "inside")
CLUSTERS = ("fresh", "long-lived")
PARTS = ("lag", "saved")
# Spread decisions at least this far apart, so that an override is read before the next.
DECISION_SPACING_S = 2.5


# ------------------------------------------------------------------ validation
def _epoch_of(checkpoint) -> int:
    with checkpoint.as_directory() as directory:
        return json.loads(Path(directory, "epoch.json").read_text())["epoch"]


def target_validate_fn(checkpoint, config: dict) -> dict[str, float]:
    """The lag's validation: real accuracy, and target_hit on every period-th checkpoint."""
    metrics = validate_checkpoint(checkpoint, noisy_copies=config.get("noisy_copies", 0))
    hit = _epoch_of(checkpoint) % config["period"] == config["period"] - 1
    return {"accuracy": metrics["accuracy"], "target_hit": 1.0 if hit else 0.0}


def accuracy_validate_fn(checkpoint, config: dict) -> dict[str, float]:
    """The saved-time run's validation: accuracy and loss on the held-out digits."""
    metrics = validate_checkpoint(checkpoint, noisy_copies=config.get("noisy_copies", 0))
    return {"accuracy": metrics["accuracy"], "val_loss": metrics["val_loss"]}


# ------------------------------------------------------------------ training
class Trainer:
    """One rank's model, data and optimizer: the digits MLP under DDP."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        context = ray.train.get_context()
        self.rank, world = context.get_world_rank(), context.get_world_size()
        x_train, _, y_train, _ = load_digits_split()
        self.x = torch.from_numpy(x_train[self.rank :: world])
        self.y = torch.from_numpy(y_train[self.rank :: world]).long()
        self.model = ray.train.torch.prepare_model(make_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.loss_fn = nn.CrossEntropyLoss()
        self.batches = _batch_indices(len(self.x), 32)

    def steps_for(self, seconds: float) -> int:
        """How many steps take ``seconds`` here: timed on rank 0 and sent to every rank,
        since a DDP step is a collective and every rank must take as many."""
        import torch.distributed as dist

        started = time.perf_counter()
        for _ in range(20):
            self.step()
        steps = [max(1, round(seconds / ((time.perf_counter() - started) / 20)))]
        dist.broadcast_object_list(steps, src=0)
        return steps[0]

    def step(self) -> None:
        idx = next(self.batches)
        self.optimizer.zero_grad()
        self.loss_fn(self.model(self.x[idx]), self.y[idx]).backward()
        self.optimizer.step()

    def report(self, epoch: int, validate_fn, validate_config: dict) -> None:
        import ray.train

        import trainer_integration

        if self.rank != 0:
            trainer_integration.report({"epoch": epoch}, None)
            return
        with tempfile.TemporaryDirectory() as directory:
            state = getattr(self.model, "module", self.model).state_dict()
            torch.save(state, f"{directory}/model.pt")
            Path(directory, "epoch.json").write_text(json.dumps({"epoch": epoch}))
            trainer_integration.report(
                {"epoch": epoch},
                ray.train.Checkpoint.from_directory(directory),
                validate_fn=validate_fn,
                validate_config=validate_config,
            )


def lag_train_func(config: dict[str, Any]) -> None:
    """Epochs of ``interval`` seconds of steps; each True of should_stop() is one decision
    seen (rank 0 notes it and overrides it), until rank 0 has seen ``decisions``."""
    import torch.distributed as dist

    if config["imports"] == "top":
        import trainer_integration  # noqa: F401  (what a module-level import does)
    trainer = Trainer()
    watcher = _DecisionLog(config["run"]) if trainer.rank == 0 else None
    boundaries: list[float] = []
    reported: list[float] = []
    validate_config = {"period": config["period"], "noisy_copies": config["noisy_copies"]}
    steps = trainer.steps_for(config["interval"])
    for epoch in range(config["max_epochs"]):
        for _ in range(steps):
            trainer.step()
        reported.append(time.time())
        trainer.report(epoch, target_validate_fn, validate_config)
        from trainer_integration import should_stop

        stop = should_stop()
        boundaries.append(time.time())
        if not stop:
            continue
        done = [watcher.seen(boundaries[-1]) >= config["decisions"] if watcher else False]
        dist.broadcast_object_list(done, src=0)
        if done[0]:
            break
    if watcher is not None:
        notes = {"seen": watcher.rows, "stale": watcher.stale}
        notes.update(boundaries=boundaries, reported=reported)
        Path(config["out"]).write_text(json.dumps(notes))


class _DecisionLog:
    """Rank 0's notes: when should_stop() first said True for each decision round."""

    def __init__(self, run: str) -> None:
        from validation_service import Registry

        self.run = run
        self.registry = Registry()  # opened before the loop: not part of any lag
        self.rows: list[dict[str, Any]] = []
        self.stale = 0

    def seen(self, at: float) -> int:
        """Records the decision seen at ``at`` and overrides it; returns how many so far."""
        decision = self.registry.stop_decision(self.run)
        if decision is None or not decision.stopped or _timestamp(decision.decided_at) > at:
            self.stale += 1  # the override of the previous round was not read yet
            return len(self.rows)
        self.rows.append(
            {
                "round": decision.round,
                "report_index": decision.report_index,
                "decided_at": _timestamp(decision.decided_at),
                "seen_at": at,
            }
        )
        self.registry.resume_despite_stop(self.run)
        return len(self.rows)


def saved_train_func(config: dict[str, Any]) -> None:
    """Fixed work per epoch; stops when should_stop() says so (never, without a policy)."""
    import trainer_integration

    trainer = Trainer()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    validate_config = {"noisy_copies": config["noisy_copies"]}
    epochs = 0
    for epoch in range(config["epochs"]):
        for _ in range(config["steps_per_epoch"]):
            trainer.step()
        trainer.report(epoch, accuracy_validate_fn, validate_config)
        epochs = epoch + 1
        if trainer_integration.should_stop():
            break
    loop = {
        "epochs": epochs,
        "wall": time.perf_counter() - wall0,
        "cpu": time.process_time() - cpu0,
    }
    Path(f"{config['out']}.rank{trainer.rank}").write_text(json.dumps(loop))


def _timestamp(value) -> float:
    """A registry time as a Unix time (SQLite returns it without its UTC zone)."""
    import datetime as dt

    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


# ------------------------------------------------------------------ one run
def _fit(train_func, run: str, workdir: Path, config: dict[str, Any]) -> float:
    """Runs ``train_func`` in a TorchTrainer of 2 workers; fit()'s wall time."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.perf_counter()
    result = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=NUM_WORKERS),
        run_config=RunConfig(name=run, storage_path=str(workdir / "ray_results")),
    ).fit()
    if result.error is not None:
        raise RuntimeError(f"run {run} failed: {result.error}")
    return time.perf_counter() - started


def lag_run(workdir: Path, imports: str, interval: float, decisions: int) -> dict[str, Any]:
    """One run that measures ``decisions`` decisions; its rows, with the jobs' times."""
    from validation_service import Registry, StopPolicy

    run = f"es-lag-{imports}-{uuid.uuid4().hex[:6]}"
    period = max(2, math.ceil(DECISION_SPACING_S / interval))
    registry = Registry()
    registry.set_stop_policy(run, StopPolicy("target_hit", threshold=1.0))
    out = workdir / f"{run}.json"
    config = {
        "run": run,
        "imports": imports,
        "interval": interval,
        "period": period,
        "decisions": decisions,
        "max_epochs": (decisions + 4) * period * 2,
        "noisy_copies": 0,
        "out": str(out),
    }
    _fit(lag_train_func, run, workdir, config)
    notes = json.loads(out.read_text())
    finished = {
        job.report_index: _timestamp(job.finished_at)
        for job in registry.validations(run)
        if job.finished_at is not None
    }
    reported = notes["reported"]
    for row in notes["seen"]:
        row["finished_at"] = finished[row["report_index"]]
        row["reported_at"] = reported[row["report_index"]]
    spacing = [
        b - a for a, b in zip(notes["boundaries"][:-1], notes["boundaries"][1:], strict=True)
    ]
    registry.close()
    return {
        "imports": imports,
        "interval": interval,
        "period": period,
        "measured_interval": statistics.median(spacing),
        "rows": notes["seen"],
        "stale": notes["stale"],
    }


def saved_pair(workdir: Path, args: argparse.Namespace, order: int) -> list[dict[str, Any]]:
    """The same run with and without a patience policy, one after the other."""
    from validation_service import Registry, StopPolicy

    results = []
    for policy in (True, False) if order % 2 == 0 else (False, True):
        run = f"es-saved-{'policy' if policy else 'full'}-{uuid.uuid4().hex[:6]}"
        if policy:
            Registry().set_stop_policy(
                run, StopPolicy("accuracy", patience=args.patience, min_delta=args.min_delta)
            )
        out = workdir / run
        config = {
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "noisy_copies": args.noisy_copies,
            "out": str(out),
        }
        fit_s = _fit(saved_train_func, run, workdir, config)
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(NUM_WORKERS)]
        decision = Registry().stop_decision(run)
        results.append(
            {
                "policy": policy,
                "epochs": ranks[0]["epochs"],
                "loop_s": max(r["wall"] for r in ranks),
                "worker_wall_s": sum(r["wall"] for r in ranks),
                "worker_cpu_s": sum(r["cpu"] for r in ranks),
                "fit_s": fit_s,
                "decided_at_report": None if decision is None else decision.report_index,
            }
        )
    return results


# ------------------------------------------------------------------ clusters
def _lag_cases(args: argparse.Namespace) -> list[tuple[str, float]]:
    return [(imports, interval) for interval in args.intervals for imports in args.imports]


def _one_fresh_run(case: str, decisions: int) -> None:
    """--one-run IMPORTS:INTERVAL: a new local Ray in this process, one lag run."""
    import ray

    imports, interval = case.split(":")
    workdir = fresh_ckval_home("ckval-bench-es-")
    pickle_by_value(__name__)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print("RESULT " + json.dumps(lag_run(workdir, imports, float(interval), decisions)))
    finally:
        ray.shutdown()


def fresh_lag_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for imports, interval in _lag_cases(args):
        command = [sys.executable, __file__, "--one-run", f"{imports}:{interval}"]
        command += ["--decisions", str(args.decisions)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append({"cluster": "fresh", **json.loads(line[len("RESULT ") :])})
    return results


def long_lived_runs(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The lag runs and the saved-time pairs in one Ray whose service is already up."""
    import ray

    from validation_service.config import ckval_env
    from validation_service.service import ValidationService

    workdir = fresh_ckval_home("ckval-bench-es-")
    pickle_by_value(__name__)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start()
    try:
        lag: list[dict] = []
        if "lag" in args.parts and "long-lived" in args.clusters:
            if not args.smoke:  # untimed: workers started, imports cached
                lag_run(workdir, "top", args.intervals[0], 1)
            for imports, interval in _lag_cases(args):
                result = lag_run(workdir, imports, interval, args.decisions)
                lag.append({"cluster": "long-lived", **result})
        saved: list[dict] = []
        if "saved" in args.parts:
            for repeat in range(args.repeats):
                saved.extend(saved_pair(workdir, args, repeat))
        return lag, saved
    finally:
        service.stop()
        ray.shutdown()


# ------------------------------------------------------------------ tables
def _p90(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def lag_summary(rows: list[dict[str, Any]], interval: float) -> dict[str, Any]:
    lags = [r["seen_at"] - r["decided_at"] for r in rows]
    return {
        "n": len(rows),
        "median": statistics.median(lags),
        "p90": _p90(lags),
        "max": max(lags),
        "from_job": statistics.median(r["seen_at"] - r["finished_at"] for r in rows),
        "from_report": statistics.median(r["seen_at"] - r["reported_at"] for r in rows),
        "met": statistics.median(lags) <= interval + 0.5,
    }


def render_lag(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| cluster | import | interval set / measured (s) | decisions | decision -> seen: "
        "median / p90 / max (s) | job finished -> seen, median (s) | report -> seen, median "
        "(s) | stale True | median <= interval + 0.5 s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    groups = [(r["cluster"], r["imports"], r["interval"], [r]) for r in results]
    for interval in sorted({r["interval"] for r in results}):
        same = [r for r in results if r["interval"] == interval]
        if len(same) > 1:
            groups.append(("all", "both", interval, same))
    for cluster, imports, interval, runs in groups:
        rows = [row for r in runs for row in r["rows"]]
        if not rows:
            continue
        s = lag_summary(rows, interval)
        measured = statistics.median(r["measured_interval"] for r in runs)
        lines.append(
            f"| {cluster} | {imports} | {interval:.2f} / {measured:.2f} | {s['n']} | "
            f"{s['median']:.2f} / {s['p90']:.2f} / {s['max']:.2f} | {s['from_job']:.2f} | "
            f"{s['from_report']:.2f} | {sum(r['stale'] for r in runs)} | "
            f"{'yes' if s['met'] else 'no'} |"
        )
    return lines


def render_lag_rows(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| cluster | import | interval (s) | round | deciding report | job finished -> "
        "decision (s) | decision -> seen (s) | report -> seen (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r["rows"]:
            lines.append(
                f"| {r['cluster']} | {r['imports']} | {r['interval']:.2f} | {row['round']} | "
                f"{row['report_index']} | {row['decided_at'] - row['finished_at']:.3f} | "
                f"{row['seen_at'] - row['decided_at']:.3f} | "
                f"{row['seen_at'] - row['reported_at']:.3f} |"
            )
    return lines


def render_saved(results: list[dict[str, Any]]) -> list[str]:
    policy = [r for r in results if r["policy"]]
    full = [r for r in results if not r["policy"]]
    pairs = list(zip(policy, full, strict=True))
    lines = [
        "| run | epochs trained | decided at report | training loop (s) | fit() (s) "
        "| worker wall (s) | worker CPU (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in (("patience policy", policy), ("no policy (to the end)", full)):
        decided = [r["decided_at_report"] for r in runs if r["decided_at_report"] is not None]
        lines.append(
            f"| {name} | {_median(runs, 'epochs'):g} | "
            f"{statistics.median(decided) if decided else '-'} | {_median(runs, 'loop_s'):.1f} "
            f"| {_median(runs, 'fit_s'):.1f} | {_median(runs, 'worker_wall_s'):.1f} | "
            f"{_median(runs, 'worker_cpu_s'):.1f} |"
        )
    saved = {
        key: statistics.median(1 - p[key] / f[key] for p, f in pairs)
        for key in ("epochs", "fit_s", "worker_wall_s", "worker_cpu_s")
    }
    lines += [
        "",
        f"Saved (median over {len(pairs)} pairs of 1 - policy / full): epochs "
        f"{saved['epochs']:.0%}, fit() wall time {saved['fit_s']:.0%}, worker wall time "
        f"{saved['worker_wall_s']:.0%}, worker CPU time {saved['worker_cpu_s']:.0%}.",
        "",
        "| pair | policy: epochs / loop s / fit s | full: epochs / loop s / fit s |",
        "|---:|---|---|",
    ]
    for i, (p, f) in enumerate(pairs):
        lines.append(
            f"| {i} | {p['epochs']} / {p['loop_s']:.1f} / {p['fit_s']:.1f} | "
            f"{f['epochs']} / {f['loop_s']:.1f} / {f['fit_s']:.1f} |"
        )
    return lines


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(lag: list[dict], saved: list[dict], meta: dict[str, str], args) -> str:
    lines = [f"- {k}: {v}" for k, v in meta.items()]
    if lag:
        lines += ["", "## Lag: stop decision -> should_stop() True", "", *render_lag(lag)]
        lines += ["", "Every decision:", "", *render_lag_rows(lag)]
    if saved:
        lines += [
            "",
            "## Training time saved",
            "",
            f"{args.epochs} epochs of {args.steps_per_epoch} steps at most; policy "
            f"StopPolicy('accuracy', patience={args.patience}, min_delta={args.min_delta}).",
            "",
            *render_saved(saved),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--clusters", nargs="+", choices=CLUSTERS, default=list(CLUSTERS))
    parser.add_argument("--imports", nargs="+", choices=IMPORTS, default=list(IMPORTS))
    parser.add_argument("--intervals", nargs="+", type=float, default=[0.5, 1.0])
    parser.add_argument("--decisions", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps-per-epoch", type=int, default=250)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--min-delta", type=float, default=0.005)
    parser.add_argument("--noisy-copies", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="2 decisions, 1 pair of 8 epochs")
    parser.add_argument("--one-run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.decisions, args.intervals, args.imports = 2, [0.5], ["top"]
        args.epochs, args.steps_per_epoch, args.patience, args.repeats = 8, 20, 1, 1
        args.clusters = ["long-lived"]
    if args.one_run:
        _one_fresh_run(args.one_run, args.decisions)
        return 0
    load_before = load_average()
    lag: list[dict] = []
    if "lag" in args.parts and "fresh" in args.clusters:
        lag += fresh_lag_runs(args)
    more, saved = long_lived_runs(args)
    text = render(lag + more, saved, run_description(load_before), args)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
