"""Sharded checkpoints (issue 33): every rank's folder stored as one checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py  # 4 ranks x 512 MB
    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py --shard-mb 256  # a slower machine
    PYTHONPATH=. .venv/bin/python benchmarks/bench_sharded.py --smoke  # tiny, checks it runs

Two parts, in one process with a fresh temporary CKVAL_HOME:

- **persist**: the same R rank folders (one shard file of S MB each, rank 0 also a small
  ``.metadata``) persisted three ways, the order rotated each repeat: ``cp -r`` of the R
  folders in R parallel subprocesses; fsspec ``LocalFileSystem().put(recursive=True)`` in
  R threads; ckval's own path, R processes (started beforehand) each staging its folder
  (``CheckpointStorage.stage``: copied and sha256-hashed) and renaming it into the
  checkpoint's folder as its part (``validation_service.parts.store_part``, as report()'s
  SYNC path does), then one ``validation_service.parts.assemble`` that seals the
  checkpoint. Timed until the last copy returned (ckval: the checkpoint sealed), and again
  after an ``os.sync()`` (the bytes on disk). Destinations are removed and the machine
  synced between ways, untimed. The registry is not part of this path.
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
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description  # noqa: E402

MB = 1024 * 1024
PERSIST_WAYS = ("cp", "fsspec", "ckval")
# --diagnose: where ckval's time goes, in the same R processes. "sha256" reads and hashes
# each file as stage() does, writing nothing; "py-copy" copies with stage()'s chunked
# read/write loop, hashing nothing.
DIAGNOSTIC_WAYS = ("sha256", "py-copy")
TRAIN_WAYS = ("ray-async", "ckval-async", "ckval-sync")
CHUNK = 64 * MB


# --------------------------------------------------------------------------- persist part
def write_shard(path: Path, shard_bytes: int, seed: int) -> None:
    """A file of ``shard_bytes`` incompressible bytes (written by chunks, never held whole)."""
    import numpy as np

    generator = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, shard_bytes, CHUNK):
            size = min(CHUNK, shard_bytes - start)
            f.write(generator.integers(0, 256, size, dtype=np.uint8).data)


def make_rank_folders(root: Path, ranks: int, shard_bytes: int) -> list[Path]:
    """One folder per rank, laid out as torch.distributed.checkpoint writes them."""
    folders = []
    for rank in range(ranks):
        folder = root / f"rank{rank}"
        folder.mkdir(parents=True)
        write_shard(folder / f"__{rank}_0.distcp", shard_bytes, seed=rank)
        if rank == 0:
            (folder / ".metadata").write_bytes(os.urandom(64 * 1024))
        folders.append(folder)
    return folders


def copy_with_cp(folders: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True)
    copies = [subprocess.Popen(["cp", "-r", str(f), str(dest / f.name)]) for f in folders]
    for copy in copies:
        if copy.wait() != 0:
            raise RuntimeError(f"cp -r failed: {copy.args}")


def copy_with_fsspec(folders: list[Path], dest: Path) -> None:
    from fsspec.implementations.local import LocalFileSystem

    fs = LocalFileSystem()
    dest.mkdir(parents=True)
    with ThreadPoolExecutor(len(folders)) as pool:
        futures = [pool.submit(fs.put, str(f), str(dest / f.name), recursive=True) for f in folders]
        for future in futures:
            future.result()


def ckval_rank_process(rank: int, root: str, connection) -> None:
    """One rank's storing process: waits for a (folder, checkpoint path), stores its part.

    Started before anything is timed, so that imports are not counted.
    """
    from validation_service.manifest import _CHUNK, _copy_hashing, scan_folder
    from validation_service.parts import store_part
    from validation_service.storage import CheckpointStorage

    storage = CheckpointStorage(root)
    while (task := connection.recv()) is not None:
        kind, folder, checkpoint_path, namespace, run = task
        source = scan_folder(folder)  # as ShardReporter.report does, then stage + rename
        if kind == "store":
            staged = storage.stage(source, namespace, run)
            connection.send(store_part(storage, checkpoint_path, rank, source, staged))
            continue
        for rel, src in source.files:
            target = Path(checkpoint_path) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as fin:
                if kind == "sha256":
                    _copy_hashing(fin, None)
                    continue
                with open(target, "wb") as fout:
                    while chunk := fin.read(_CHUNK):
                        fout.write(chunk)
        connection.send(None)


class CkvalRanks:
    """R processes that store one part each of a checkpoint, as report()'s SYNC path."""

    def __init__(self, ranks: int, root: Path):
        from validation_service.storage import CheckpointStorage

        self.storage = CheckpointStorage(str(root))
        context = multiprocessing.get_context("spawn")
        self.connections, self.processes = [], []
        for rank in range(ranks):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=ckval_rank_process, args=(rank, str(root), theirs), daemon=True
            )
            process.start()
            self.connections.append(ours)
            self.processes.append(process)
        self.index = 0

    def persist(self, folders: list[Path]) -> str:
        """The checkpoint sealed from every rank's folder; returns its path."""
        from validation_service.parts import assemble
        from validation_service.registry.assemblies import PartRecord

        namespace, run = "bench", "persist"
        target = self.storage.checkpoint_path(namespace, run, self.index)
        self.index += 1
        for connection, folder in zip(self.connections, folders, strict=True):
            connection.send(("store", str(folder), target, namespace, run))
        parts = []
        for rank, connection in enumerate(self.connections):
            path, files = connection.recv()
            size = sum(entry["size"] for entry in files.values())
            parts.append(PartRecord(rank, path, files, size, {}))
        assemble(self.storage, target, parts, "warn")
        return target

    def diagnose(self, kind: str, folders: list[Path], dest: Path) -> None:
        """One of DIAGNOSTIC_WAYS, each process on its rank's folder."""
        for connection, folder in zip(self.connections, folders, strict=True):
            connection.send((kind, str(folder), str(dest / folder.name), "", ""))
        for connection in self.connections:
            connection.recv()

    def warm_up(self, scratch: Path) -> None:
        """One tiny checkpoint through every process (imports, first file system calls)."""
        shutil.rmtree(self.persist(make_rank_folders(scratch, len(self.processes), MB)))
        shutil.rmtree(scratch)

    def close(self) -> None:
        for connection in self.connections:
            connection.send(None)
        for process in self.processes:
            process.join(timeout=30)


def persist_part(
    workdir: Path, ranks: int, shard_mb: float, repeats: int, diagnose: bool
) -> dict[str, Any]:
    shard_bytes = int(shard_mb * MB)
    folders = make_rank_folders(workdir / "ranks", ranks, shard_bytes)
    total_mb = sum(f.stat().st_size for d in folders for f in d.iterdir()) / MB
    ckval = CkvalRanks(ranks, workdir / "storage")
    ckval.warm_up(workdir / "warm-up")
    all_ways = PERSIST_WAYS + (DIAGNOSTIC_WAYS if diagnose else ())
    timings: dict[str, list[tuple[float, float]]] = {way: [] for way in all_ways}
    try:
        for repeat in range(repeats):
            turn = repeat % len(all_ways)
            for way in all_ways[turn:] + all_ways[:turn]:
                os.sync()  # the last way's writes are not this way's to wait for
                dest = workdir / "raw" / f"{way}-{repeat}"
                started = time.perf_counter()
                if way == "cp":
                    copy_with_cp(folders, dest)
                elif way == "fsspec":
                    copy_with_fsspec(folders, dest)
                elif way == "ckval":
                    dest = Path(ckval.persist(folders))
                else:
                    dest.mkdir(parents=True)
                    ckval.diagnose(way, folders, dest)
                copied = time.perf_counter() - started
                os.sync()
                synced = time.perf_counter() - started
                stored_mb = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) / MB
                if stored_mb < total_mb and way != "sha256":
                    raise RuntimeError(f"{way} stored {stored_mb:.1f} of {total_mb:.1f} MB")
                timings[way].append((copied, synced))
                print(
                    f"  persist {repeat + 1}/{repeats} {way}: {total_mb / copied:.0f} MB/s "
                    f"({copied:.2f} s; {synced:.2f} s with sync), load {load_average()}",
                    flush=True,
                )
                shutil.rmtree(dest)
    finally:
        ckval.close()
        shutil.rmtree(workdir / "ranks", ignore_errors=True)
    return {"total_mb": total_mb, "timings": timings}


def persist_table(result: dict[str, Any]) -> str:
    total_mb, timings = result["total_mb"], result["timings"]
    medians = {
        way: (statistics.median(c for c, _ in runs), statistics.median(s for _, s in runs))
        for way, runs in timings.items()
    }
    rows = [
        "| way | each run (s) | until returned, median (s) | MB/s | with os.sync(), median (s) | "
        "MB/s with sync | ckval / this, MB/s (target >= 0.8) | with sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ckval_copied, ckval_synced = medians["ckval"]
    for way in timings:
        copied, synced = medians[way]
        every = ", ".join(f"{c:.2f}" for c, _ in timings[way])
        rows.append(
            f"| {way} | {every} | {copied:.2f} | {total_mb / copied:.0f} | {synced:.2f} | "
            f"{total_mb / synced:.0f} | {copied / ckval_copied:.2f} | "
            f"{synced / ckval_synced:.2f} |"
        )
    return "\n".join(rows)


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
        "--diagnose", action="store_true", help="persist: also sha256 alone and copy alone"
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
