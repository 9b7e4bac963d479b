"""bench_sharded.py's persist part: R rank folders persisted by `cp -r`, by fsspec `put`
and by ckval's sharded report path (SYNC and ASYNC), in the same run.

ckval's ways run in R processes started beforehand (imports not counted), one per rank,
each with its own reporter on one registry (SQLite under the run's CKVAL_HOME), as the
ranks of a Ray Train run have: each calls ``ShardReporter.report`` with its folder (SYNC:
returns once its copy is stored; ASYNC: at once, the copy on the reporter's thread) and
the lowest rank seals the checkpoint once every part is stored and recorded (the parts
made one folder, one manifest, registered).
Timed from the first report to the seal. Ray Train itself is not on this path (its rank
sync is what the train part measures).

``--diagnose`` adds rows that split ckval's copy, in the same processes: ``one-pass
blake3`` and ``one-pass sha256`` (``manifest.copy_hashing`` of each file into a plain
destination: no staging, rename, registry or seal), ``hash only`` (read and hash,
nothing written) and ``copy only`` (the same buffer loop, nothing hashed).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import load_average

MB = 1024 * 1024
CHUNK = 64 * MB
PERSIST_WAYS = ("cp", "fsspec", "ckval-sync", "ckval-async")
DIAGNOSTIC_WAYS = ("one-pass blake3", "one-pass sha256", "hash only", "copy only")
RUN = "persist"


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


def rank_process(rank: int, world_size: int, connection) -> None:
    """One rank's process: reports its folder as its part, waits for the seal, or runs a
    diagnostic."""
    from ray.train import Checkpoint

    from trainer_integration._parts import ShardReporter
    from trainer_integration._reporter import RunReporter
    from trainer_integration._request import CheckpointUploadMode, PreparedReport
    from validation_service.registry.assemblies import ReportCall

    reporter = RunReporter(RUN, start_service=False)
    shards = {}
    while (task := connection.recv()) is not None:
        kind, argument = task
        if kind == "open":
            reporter.prepare()
            connection.send(None)
        elif kind in ("SYNC", "ASYNC"):
            folder, group = argument
            call = ReportCall(group, 1, rank, world_size)
            prepared = PreparedReport({"step": 0}, None, CheckpointUploadMode[kind], False)
            shards[group] = ShardReporter(reporter, rank).report(
                prepared, Checkpoint.from_directory(folder), call
            )
            connection.send(None)
        elif kind == "seal":
            # The lowest rank seals once every part is stored and recorded; the others'
            # outcome is None.
            sealed = shards.pop(argument).sealed.result()
            connection.send(None if sealed is None else sealed.uri)
        else:
            diagnose(kind, *argument)
            connection.send(None)
    reporter.close()


def diagnose(kind: str, folder: str, dest: str) -> None:
    from validation_service.manifest import _BUFFER, copy_hashing

    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb", buffering=0) as fin:
            if kind == "hash only":
                copy_hashing(fin, None)
                continue
            with open(os.path.join(dest, name), "wb") as fout:
                if kind == "copy only":
                    buffer = bytearray(_BUFFER)
                    view = memoryview(buffer)
                    while count := fin.readinto(buffer):
                        fout.write(view[:count])
                else:
                    copy_hashing(fin, fout, kind.rsplit(" ", 1)[1])


class CkvalRanks:
    """R processes that report one part each of a checkpoint, as report() does."""

    def __init__(self, ranks: int):
        context = multiprocessing.get_context("spawn")
        self.connections, self.processes = [], []
        for rank in range(ranks):
            ours, theirs = context.Pipe()
            process = context.Process(target=rank_process, args=(rank, ranks, theirs), daemon=True)
            process.start()
            self.connections.append(ours)
            self.processes.append(process)
        for connection in self.connections:  # one at a time: the first makes the registry
            connection.send(("open", None))
            connection.recv()

    def persist(self, folders: list[Path], mode: str) -> str:
        """The checkpoint sealed from every rank's folder; returns its path."""
        group = uuid.uuid4().hex[:12]
        for connection, folder in zip(self.connections, folders, strict=True):
            connection.send((mode, (str(folder), group)))
        for connection in self.connections:
            connection.recv()
        for connection in self.connections:
            connection.send(("seal", group))
        [uri, *_] = [connection.recv() for connection in self.connections]
        return uri

    def diagnose(self, kind: str, folders: list[Path], dest: Path) -> None:
        """One of DIAGNOSTIC_WAYS, each process on its rank's folder."""
        for connection, folder in zip(self.connections, folders, strict=True):
            connection.send((kind, (str(folder), str(dest / folder.name))))
        for connection in self.connections:
            connection.recv()

    def warm_up(self, scratch: Path) -> None:
        """One tiny checkpoint through every process and mode (first calls, threads)."""
        for mode in ("SYNC", "ASYNC"):
            shutil.rmtree(self.persist(make_rank_folders(scratch, len(self.processes), MB), mode))
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
    ckval = CkvalRanks(ranks)
    ckval.warm_up(workdir / "warm-up")
    all_ways = PERSIST_WAYS + (DIAGNOSTIC_WAYS if diagnose else ())
    timings: dict[str, list[tuple[float, float]]] = {way: [] for way in all_ways}
    try:
        for repeat in range(repeats):
            turn = repeat % len(all_ways)
            for way in all_ways[turn:] + all_ways[:turn]:
                os.sync()  # the last way's writes are not this way's to wait for
                dest = workdir / "raw" / f"{way.replace(' ', '-')}-{repeat}"
                started = time.perf_counter()
                if way == "cp":
                    copy_with_cp(folders, dest)
                elif way == "fsspec":
                    copy_with_fsspec(folders, dest)
                elif way.startswith("ckval-"):
                    dest = Path(ckval.persist(folders, way.split("-")[1].upper()))
                else:
                    ckval.diagnose(way, folders, dest)
                copied = time.perf_counter() - started
                os.sync()
                synced = time.perf_counter() - started
                stored_mb = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) / MB
                if stored_mb < total_mb and way != "hash only":
                    raise RuntimeError(f"{way} stored {stored_mb:.1f} of {total_mb:.1f} MB")
                timings[way].append((copied, synced))
                print(
                    f"  persist {repeat + 1}/{repeats} {way}: {total_mb / copied:.0f} MB/s "
                    f"({copied:.2f} s; {synced:.2f} s with sync), load {load_average()}",
                    flush=True,
                )
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        ckval.close()
        shutil.rmtree(workdir / "ranks", ignore_errors=True)
    return {"total_mb": total_mb, "timings": timings}


def persist_table(result: dict[str, Any]) -> str:
    """Each way's medians, and each ckval way's throughput over cp's and fsspec's."""
    total_mb, timings = result["total_mb"], result["timings"]
    medians = {
        way: (statistics.median(c for c, _ in runs), statistics.median(s for _, s in runs))
        for way, runs in timings.items()
    }
    rows = [
        "| way | each run (s) | until returned, median (s) | MB/s | with os.sync(), median (s) | "
        "MB/s with sync | / cp, MB/s (target >= 0.8) | / fsspec | / cp, with sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cp, fsspec = medians["cp"], medians["fsspec"]
    for way in timings:
        copied, synced = medians[way]
        every = ", ".join(f"{c:.2f}" for c, _ in timings[way])
        rows.append(
            f"| {way} | {every} | {copied:.2f} | {total_mb / copied:.0f} | {synced:.2f} | "
            f"{total_mb / synced:.0f} | {cp[0] / copied:.2f} | {fsspec[0] / copied:.2f} | "
            f"{cp[1] / synced:.2f} |"
        )
    return "\n".join(rows)
