"""Sharded checkpoints (issue 33): every rank's folder stored as one checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py  # 4 ranks x 512 MB
    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py --shard-mb 256  # a slower machine
    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py --smoke  # tiny, checks it runs

Two parts, in one process with a fresh temporary CKVAL_HOME:

- **persist**: the same R rank folders (one shard file of S MB each, rank 0 also a small
  ``.metadata``) persisted four ways, the order rotated each repeat: ``cp -r`` of the R
  folders in R parallel subprocesses; fsspec ``LocalFileSystem().put(recursive=True)`` in
  R threads; ckval's sharded report path in SYNC and in ASYNC mode, R processes (started
  beforehand) each reporting its folder as its part (``ShardReporter.report``: copied and
  hashed in one pass, BLAKE3) and the lowest rank sealing the checkpoint
  (``ShardReporter.seal``), on a SQLite registry (see _sharded_persist.py). Timed until
  the last copy returned (ckval: the checkpoint sealed and registered), and again after
  an ``os.sync()`` (the bytes on disk). Destinations are removed and the machine synced
  between ways, untimed.
- **train**: a TorchTrainer with R CPU workers; each rank holds an S MB shard in memory,
  writes it to a new temporary folder of its own before each report and reports that
  folder on every rank: ckval ``report(..., checkpoint_upload_mode=ASYNC|SYNC,
  validate_fn=...)`` or Ray Train's ``ray.train.report(..., checkpoint_upload_mode=ASYNC)``.
  Per rank: the time each report() call blocks the training thread, and the process RSS
  just before the first report and its peak (a thread samples it every 20 ms) until every
  folder it reported is gone (copied and deleted; SYNC's folders are deleted by the loop
  after report() returns). ``registered`` is from the end of the last rank's loop (its
  last report returned; SYNC: and its folder deleted) until ``registry.checkpoints(run)``
  lists every report (polled every 50 ms by the driver); for Ray Train, until ``fit()``
  returned. One untimed ckval-async run (1 MB shards) comes first, then the ways,
  rotated each repeat.

MB is 2**20 bytes. Prints markdown tables; ``--out`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description  # noqa: E402
from _sharded_persist import MB, persist_part, persist_table  # noqa: E402

TRAIN_WAYS = ("ray-async", "ckval-async", "ckval-sync")


# ----------------------------------------------------------------------------- train part
def noop_validate(checkpoint, config) -> dict:
    """Counts the checkpoint's files: the job exists, the benchmark measures storing."""
    with checkpoint.as_directory() as directory:
        return {"files": float(len(os.listdir(directory)))}


class RssSampler:
    """This process's RSS every ``interval_s`` in a thread; ``peak`` is the largest seen."""

    def __init__(self, interval_s: float = 0.02):
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self.before = self.peak = self.process.memory_info().rss
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def train_func(config: dict[str, Any]) -> None:
    """Each report: this rank's shard written into a new folder of its own, then reported."""
    import numpy as np
    import ray.train

    from trainer_integration import CheckpointUploadMode, report

    rank = ray.train.get_context().get_world_rank()
    way, shard_bytes = config["way"], int(config["shard_mb"] * MB)
    # The shard this rank holds in memory, as a training process holds its part of the model.
    shard = np.random.default_rng(rank).integers(0, 256, shard_bytes, dtype=np.uint8)
    scratch = Path(config["scratch"])
    folders, blocked, written = [], [], []
    sampler = None
    for index in range(config["reports"]):
        started = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix=f"rank{rank}-report{index}-", dir=scratch))
        shard[:8] = index  # another checkpoint's bytes
        with open(folder / f"__{rank}_0.distcp", "wb") as f:
            f.write(shard.data)
        if rank == 0:
            (folder / ".metadata").write_bytes(b"m" * 4096)
        written.append(time.perf_counter() - started)
        folders.append(folder)
        checkpoint = ray.train.Checkpoint.from_directory(str(folder))
        metrics = {"step": index, "loss": 1.0 / (index + 1)}
        if sampler is None:
            sampler = RssSampler()
        started = time.perf_counter()
        if way == "ray-async":
            ray.train.report(
                metrics,
                checkpoint=checkpoint,
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            )
        else:
            mode = CheckpointUploadMode.ASYNC if way == "ckval-async" else CheckpointUploadMode.SYNC
            report(metrics, checkpoint, validate_fn=noop_validate, checkpoint_upload_mode=mode)
        blocked.append(time.perf_counter() - started)
        if way == "ckval-sync":
            shutil.rmtree(folder)  # stored when report() returned: training may delete it
    loop_end = time.time()
    deadline = time.monotonic() + config["drain_s"]
    while any(f.exists() for f in folders) and time.monotonic() < deadline:
        time.sleep(0.02)  # ASYNC: each folder is deleted once its copy is stored
    sampler.stop()
    left = [str(f) for f in folders if f.exists()]
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
    Path(f"{config['timings']}.rank{rank}").write_text(
        json.dumps(
            {
                "blocked": blocked,
                "written": written,
                "loop_end": loop_end,
                "rss_before": sampler.before,
                "rss_peak": sampler.peak,
                "folders_left": len(left),
            }
        )
    )


def poll_registered(run: str, reports: int, stop: threading.Event, found: dict) -> None:
    """Notes when the registry first lists every report of ``run``."""
    from validation_service.registry.registry import Registry

    registry = Registry()
    while not stop.is_set():
        try:
            if len(registry.checkpoints(run)) >= reports:
                found["at"] = time.time()
                return
        except Exception:  # the run is not in the registry yet
            pass
        time.sleep(0.05)


def train_once(way: str, workdir: Path, ranks: int, shard_mb: float, reports: int) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run = f"sharded-{way}-{uuid.uuid4().hex[:6]}"
    scratch = workdir / "scratch" / run
    scratch.mkdir(parents=True)
    timings = workdir / "timings" / run
    timings.parent.mkdir(exist_ok=True)
    config = {
        "way": way,
        "shard_mb": shard_mb,
        "reports": reports,
        "scratch": str(scratch),
        "timings": str(timings),
        "drain_s": 300,
    }
    stop, found = threading.Event(), {}
    poller = None
    if way != "ray-async":
        poller = threading.Thread(target=poll_registered, args=(run, reports, stop, found))
        poller.start()
    try:
        result = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=ranks),
            run_config=RunConfig(name=run, storage_path=str(workdir / "ray_results")),
        ).fit()
        fit_returned = time.time()
        if poller is not None:
            poller.join(timeout=300)
    finally:
        stop.set()
    if result.error is not None:
        raise RuntimeError(f"{way}: the run failed: {result.error}")
    per_rank = [json.loads(Path(f"{timings}.rank{r}").read_text()) for r in range(ranks)]
    loop_end = max(r["loop_end"] for r in per_rank)
    registered_at = found.get("at", fit_returned) if way != "ray-async" else fit_returned
    if way != "ray-async":  # validated (no-op) before its files go: no failing job in the log
        from validation_service.registry.registry import Registry

        Registry().wait(run, timeout_s=120)
    shutil.rmtree(workdir / "ray_results" / run, ignore_errors=True)
    for stored in (workdir / "ckval" / "checkpoints").glob(f"*/{run}"):
        shutil.rmtree(stored, ignore_errors=True)
    return {
        "way": way,
        "ranks": per_rank,
        "registered_s": registered_at - loop_end,
        "until_fit_s": fit_returned - loop_end,
        "found": "at" in found or way == "ray-async",
    }


def train_part(workdir: Path, ranks: int, shard_mb: float, reports: int, repeats: int, warm: bool):
    import ray

    from validation_service import ValidationService
    from validation_service.config import ckval_env

    pickle_by_value(__name__)
    ray.init(
        num_cpus=ranks + 2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start(pools={"CPU": 1}, default_pool_size=1)
    runs: list[dict[str, Any]] = []
    try:
        if warm:  # the service, its validation worker and the imports, before any timing
            print("  warm-up: ckval-async (1 MB shards, not measured) ...", flush=True)
            train_once("ckval-async", workdir, ranks, 1, 2)
        for repeat in range(repeats):
            for way in TRAIN_WAYS[repeat % 3 :] + TRAIN_WAYS[: repeat % 3]:
                run = train_once(way, workdir, ranks, shard_mb, reports)
                blocked = [b for r in run["ranks"] for b in r["blocked"]]
                print(
                    f"  train {repeat + 1}/{repeats} {way}: blocked median "
                    f"{statistics.median(blocked) * 1000:.0f} ms (max {max(blocked) * 1000:.0f}), "
                    f"registered {run['registered_s']:.2f} s, fit() {run['until_fit_s']:.2f} s, "
                    f"load {load_average()}",
                    flush=True,
                )
                runs.append(run)
    finally:
        service.stop()
        ray.shutdown()
    return runs


def train_summary(runs: list[dict[str, Any]], way: str, shard_mb: float) -> dict[str, float]:
    ours = [r for r in runs if r["way"] == way]
    ranks = [rank for r in ours for rank in r["ranks"]]
    blocked = [b for rank in ranks for b in rank["blocked"]]
    first = [rank["blocked"][0] for rank in ranks]
    later = [b for rank in ranks for b in rank["blocked"][1:]]
    growth = [(rank["rss_peak"] - rank["rss_before"]) / MB for rank in ranks]
    return {
        "runs": len(ours),
        "blocked": statistics.median(blocked),
        "blocked_max": max(blocked),
        "first": statistics.median(first),
        "later": statistics.median(later) if later else float("nan"),
        "written": statistics.median(w for rank in ranks for w in rank["written"]),
        "registered": statistics.median(r["registered_s"] for r in ours),
        "registered_all": [r["registered_s"] for r in ours],
        "until_fit": statistics.median(r["until_fit_s"] for r in ours),
        "rss_before": statistics.median(rank["rss_before"] / MB for rank in ranks),
        "rss_peak": statistics.median(rank["rss_peak"] / MB for rank in ranks),
        "growth": statistics.median(growth),
        "growth_max": max(growth),
        "growth_per_shard": max(growth) / shard_mb,
        "not_found": sum(not r["found"] for r in ours),
        "folders_left": sum(rank["folders_left"] for rank in ranks),
    }


def train_tables(runs: list[dict[str, Any]], shard_mb: float) -> str:
    summaries = {way: train_summary(runs, way, shard_mb) for way in TRAIN_WAYS}
    ray_ = summaries["ray-async"]
    rows = [
        "| way | runs | blocked per report, median (ms) | first / later reports (ms) | max (ms) "
        "| blocked / Ray's (target <= 1.0) | last report -> registered, median (s) | "
        "registered / Ray's | until fit() (s) | shard written (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for way, s in summaries.items():
        every = ", ".join(f"{v:.2f}" for v in s["registered_all"])
        rows.append(
            f"| {way} | {s['runs']} | {s['blocked'] * 1000:.1f} | {s['first'] * 1000:.1f} / "
            f"{s['later'] * 1000:.1f} | {s['blocked_max'] * 1000:.0f} | "
            f"{s['blocked'] / ray_['blocked']:.2f} | {s['registered']:.2f} ({every}) | "
            f"{s['registered'] / ray_['registered']:.2f} | {s['until_fit']:.2f} | "
            f"{s['written'] * 1000:.0f} |"
        )
    rows += [
        "",
        f"| way | RSS before the first report, median (MB) | peak while persisting, median (MB) "
        f"| peak - before: median / max (MB) | max / shard ({shard_mb:g} MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, s in summaries.items():
        rows.append(
            f"| {way} | {s['rss_before']:.0f} | {s['rss_peak']:.0f} | {s['growth']:.0f} / "
            f"{s['growth_max']:.0f} | {s['growth_per_shard']:.2f} |"
        )
    problems = [
        f"{way}: {s['not_found']} run(s) never listed every report; "
        f"{s['folders_left']} folder(s) not deleted"
        for way, s in summaries.items()
        if s["not_found"] or s["folders_left"]
    ]
    return "\n".join(rows + [""] + [f"PROBLEM: {p}" for p in problems])


# ----------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--shard-mb", type=float, default=512, help="each rank's shard")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reports", type=int, default=3, help="reports per training run")
    parser.add_argument("--parts", nargs="+", choices=["persist", "train"], default=None)
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="persist: also the one-pass copy (BLAKE3, SHA-256), hashing alone, copying alone",
    )
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary CKVAL_HOME")
    args = parser.parse_args(argv)
    args.parts = args.parts or ["persist", "train"]
    if args.smoke:
        args.shard_mb, args.repeats, args.reports, args.warmup = 2, 1, 2, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall_started = time.perf_counter()
    load_before = load_average()
    workdir = fresh_ckval_home("ckval-bench-sharded-")
    sections = []
    try:
        if "persist" in args.parts:
            print(f"persist: {args.ranks} folders of {args.shard_mb:g} MB ...", flush=True)
            persisted = persist_part(
                workdir, args.ranks, args.shard_mb, args.repeats, args.diagnose
            )
            sections.append(
                f"### Persist {persisted['total_mb']:.0f} MB from {args.ranks} rank folders "
                f"(median of {args.repeats})\n\n{persist_table(persisted)}"
            )
        if "train" in args.parts:
            print(f"train: {args.ranks} ranks x {args.shard_mb:g} MB x {args.reports} reports")
            runs = train_part(
                workdir, args.ranks, args.shard_mb, args.reports, args.repeats, args.warmup
            )
            sections.append(
                f"### In Ray Train: {args.ranks} ranks, {args.shard_mb:g} MB shards, "
                f"{args.reports} reports per run\n\n{train_tables(runs, args.shard_mb)}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta = run_description(load_before)
    meta["wall_s"] = f"{time.perf_counter() - wall_started:.0f}"
    header = "\n".join(f"- {key}: {value}" for key, value in meta.items())
    markdown = header + "\n\n" + "\n\n".join(sections)
    print("\n" + markdown)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown + "\n")
    return 1 if "PROBLEM:" in markdown else 0


if __name__ == "__main__":
    sys.exit(main())
