"""Core overheads of ckval: report() blocked time, dispatch latency, no-op validation throughput.

    .venv/bin/python benchmarks/bench_core.py            # full: 40 reports of 10 MB, 300 no-ops
    .venv/bin/python benchmarks/bench_core.py --smoke    # tiny sizes, for CI

Everything runs on the embedded default (local Ray, SQLite, local folder) in a fresh
temporary CKVAL_HOME. Prints a markdown table; --out also writes it to a file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def noop_validate(checkpoint, config):
    """Records when it started; does no work (measures the service, not the user)."""
    return {"started_at": time.time()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_checkpoint(root: Path, index: int, size_bytes: int):
    from ray.train import Checkpoint

    directory = root / f"ckpt-{index}"
    directory.mkdir()
    (directory / "model.pt").write_bytes(os.urandom(size_bytes))
    return Checkpoint.from_directory(str(directory))


def bench_report_and_dispatch(client, registry, run: str, reports: int, size_mb: float, gap_s):
    """report() of SYNC checkpoints on local disk, one at a time with the service idle."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-src-"))
    checkpoints = [make_checkpoint(scratch, i, int(size_mb * 1024 * 1024)) for i in range(reports)]
    blocked, returned_at = [], {}
    for checkpoint in checkpoints:
        start = time.perf_counter()
        index = client.report({"loss": 1.0}, checkpoint, validate_fn=noop_validate)
        blocked.append(time.perf_counter() - start)
        returned_at[index] = time.time()
        time.sleep(gap_s)  # pacing: each validation is dispatched to an idle service
    registry.wait(run, timeout_s=600)
    dispatch = [
        c.validated_metrics["started_at"] - returned_at[c.report_index]
        for c in registry.checkpoints(run)
        if c.report_index in returned_at
    ]
    return blocked, dispatch


def bench_upload_only(storage, reports: int, size_mb: float) -> list[float]:
    """The copy + sha256 part of report(), alone, for the breakdown."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-upload-"))
    times = []
    for i in range(reports):
        checkpoint = make_checkpoint(scratch, i, int(size_mb * 1024 * 1024))
        start = time.perf_counter()
        storage.upload(checkpoint.path, "bench", "upload-only", i)
        times.append(time.perf_counter() - start)
    return times


def bench_noop_throughput(client, registry, run: str, count: int) -> tuple[float, float]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-noop-"))
    checkpoints = [make_checkpoint(scratch, i, 1024) for i in range(count)]
    start = time.perf_counter()
    for checkpoint in checkpoints:
        client.report({"loss": 1.0}, checkpoint, validate_fn=noop_validate)
    enqueued = time.perf_counter() - start
    registry.wait(run, timeout_s=1200)
    elapsed = time.perf_counter() - start
    return count / elapsed, count / enqueued


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=40)
    parser.add_argument("--size-mb", type=float, default=10.0)
    parser.add_argument("--noop", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--gap-s", type=float, default=0.25)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.reports, args.size_mb, args.noop, args.gap_s = 4, 1.0, 12, 0.1

    os.environ["CKVAL_HOME"] = tempfile.mkdtemp(prefix="ckval-bench-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from trainer_integration import Client
    from validation_service import Registry, ValidationService
    from validation_service.config import ckval_env
    from validation_service.storage import CheckpointStorage

    ray.init(
        num_cpus=args.concurrency + 2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service = ValidationService.start(pools={"CPU": args.concurrency})
    registry = Registry()
    warm = Client("bench-warmup")
    bench_noop_throughput(warm, registry, "bench-warmup", args.concurrency)  # start workers

    client = Client("bench-report")
    blocked, dispatch = bench_report_and_dispatch(
        client, registry, "bench-report", args.reports, args.size_mb, args.gap_s
    )
    upload = bench_upload_only(CheckpointStorage(tempfile.mkdtemp()), args.reports, args.size_mb)
    throughput, enqueue_rate = bench_noop_throughput(
        Client("bench-noop"), registry, "bench-noop", args.noop
    )
    status = service.status()
    service.stop()
    ray.shutdown()

    ms = 1000.0
    rows = [
        (
            f"report() blocked time, SYNC, {args.size_mb:.0f} MB, local disk: median",
            f"{statistics.median(blocked) * ms:.1f} ms",
        ),
        ("report() blocked time: p95", f"{percentile(blocked, 0.95) * ms:.1f} ms"),
        (
            "  of which copy + sha256 of the checkpoint (alone): median",
            f"{statistics.median(upload) * ms:.1f} ms",
        ),
        (
            "dispatch latency, report() returned -> validate_fn started: median",
            f"{statistics.median(dispatch) * ms:.1f} ms",
        ),
        ("dispatch latency: p95", f"{percentile(dispatch, 0.95) * ms:.1f} ms"),
        ("dispatch latency: max", f"{max(dispatch) * ms:.1f} ms"),
        (
            f"no-op validations end to end, concurrency {args.concurrency}",
            f"{throughput:.1f} validations/s",
        ),
        (
            "no-op reports acknowledged (1 KB checkpoints, 1 reporter)",
            f"{enqueue_rate:.1f} reports/s",
        ),
    ]
    table = "\n".join(
        ["| measure | value |", "| --- | --- |", *[f"| {a} | {b} |" for a, b in rows]]
    )
    header = (
        f"reports={args.reports} size={args.size_mb} MB no-op={args.noop} "
        f"concurrency={args.concurrency} python={sys.version.split()[0]} "
        f"ray={ray.__version__} cores={os.cpu_count()} date={time.strftime('%Y-%m-%d')}"
    )
    text = f"{header}\n\n{table}\n\nservice: claimed={status['claimed']} stale={status['stale']}"
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
