"""Registry scale: best_checkpoints(k=10) latency by size, and registration throughput.

    .venv/bin/python benchmarks/bench_registry.py                  # 10k, 100k, 1M; both databases
    .venv/bin/python benchmarks/bench_registry.py --sizes 10000 100000 --backends sqlite
    .venv/bin/python benchmarks/bench_registry.py --smoke          # tiny sizes, for CI

Each size is loaded into a fresh database (SQLite in a temp folder; PostgreSQL as a new
database on CKVAL_TEST_POSTGRES_URL's server, dropped afterwards) with 5 metrics per
checkpoint, then best_checkpoints(k=10) is timed within one run and across all runs.
Registration throughput runs 8 reporter processes calling Client.report() against the
running service; it counts reports acknowledged per second.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

POSTGRES_URL = os.environ.get(
    "CKVAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
METRICS = ("accuracy", "loss", "f1", "precision", "recall")


class Database:
    """A fresh database for one measurement, removed afterwards."""

    def __init__(self, backend: str):
        self.backend = backend
        if backend == "sqlite":
            self.url = f"sqlite:///{tempfile.mkdtemp(prefix='bench-reg-')}/registry.db"
            return
        import sqlalchemy as sa

        self.name = f"ckval_bench_{uuid.uuid4().hex[:8]}"
        self.admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        self.url = (
            sa.engine.make_url(POSTGRES_URL)
            .set(database=self.name)
            .render_as_string(hide_password=False)
        )

    def drop(self) -> None:
        if self.backend == "sqlite":
            return
        import sqlalchemy as sa

        with self.admin.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname=:d"),
                {"d": self.name},
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}"'))
        self.admin.dispose()


def load(registry, size: int, runs: int) -> float:
    """Imports `size` checkpoints spread over `runs` runs; returns the seconds it took."""
    rng = random.Random(0)
    per_run = size // runs
    start = time.perf_counter()
    for r in range(runs):
        run_id = registry.ensure_run(f"run-{r}", storage_root="/bench")
        for first in range(0, per_run, 20_000):
            batch = [
                {
                    "report_index": i,
                    "uri": f"/bench/run-{r}/checkpoint_{i:07d}",
                    "metrics": {name: rng.random() for name in METRICS},
                }
                for i in range(first, min(first + 20_000, per_run))
            ]
            registry.import_checkpoints(run_id, batch)
    return time.perf_counter() - start


def time_best(registry, run: str | None, repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        metric = METRICS[i % len(METRICS)]
        start = time.perf_counter()
        best = registry.best_checkpoint_records(run, metric, "max" if i % 2 else "min", k=10)
        times.append(time.perf_counter() - start)
        assert len(best) == 10
    return times


def bench_best(backends: list[str], sizes: list[int], runs: int, repeats: int) -> list[str]:
    from validation_service.registry.registry import Registry

    rows = []
    for backend in backends:
        for size in sizes:
            database = Database(backend)
            try:
                registry = Registry(database.url, upgrade=True)
                load_s = load(registry, size, runs)
                registry.analyze()
                time_best(registry, "run-0", 3)  # warm the cache
                in_run = time_best(registry, "run-0", repeats)
                across = time_best(registry, None, repeats)
                rows.append(
                    f"| {backend} | {size:,} | {size // runs:,} | "
                    f"{statistics.median(in_run) * 1000:.2f} | {p95(in_run) * 1000:.2f} | "
                    f"{statistics.median(across) * 1000:.2f} | {p95(across) * 1000:.2f} | "
                    f"{size / load_s:,.0f} |"
                )
                print(rows[-1], flush=True)
                registry.close()
            finally:
                database.drop()
    return rows


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def noop_validate(checkpoint, config):
    return {"ok": 1.0}


def reporter(run: str, reports: int, env: dict, ready, go, results) -> None:
    os.environ.update(env)
    import cloudpickle
    from ray.train import Checkpoint

    # This module is __mp_main__ here, which Ray workers cannot import: ship by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    from trainer_integration import Client

    scratch = Path(tempfile.mkdtemp(prefix="bench-reporter-"))
    client = Client(run)
    checkpoints = []
    for i in range(reports):
        directory = scratch / str(i)
        directory.mkdir()
        (directory / "model.bin").write_bytes(os.urandom(1024))
        checkpoints.append(Checkpoint.from_directory(str(directory)))
    client.report({"warmup": 1}, checkpoints[0], validate_fn=noop_validate)  # connect, start
    ready.put(run)
    go.wait()
    start = time.perf_counter()
    for checkpoint in checkpoints[1:]:
        client.report({"loss": 0.5}, checkpoint, validate_fn=noop_validate)
    results.put((run, start, time.perf_counter(), reports - 1))


def bench_registration(backends: list[str], reporters: int, reports: int) -> list[str]:
    import ray

    from validation_service.config import ckval_env
    from validation_service.registry.registry import Registry
    from validation_service.service import ValidationService

    rows = []
    for backend in backends:
        database = Database(backend)
        home = tempfile.mkdtemp(prefix="bench-reg-home-")
        os.environ.update(CKVAL_HOME=home, CKVAL_DATABASE_URL=database.url)
        registry = Registry(database.url, upgrade=True)
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": ckval_env()},
        )
        try:
            service = ValidationService.start()
            env = {
                **ckval_env(),
                "CKVAL_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
                "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
            }
            context = multiprocessing.get_context("spawn")
            ready, results, go = context.Queue(), context.Queue(), context.Event()
            processes = [
                context.Process(
                    target=reporter, args=(f"reporter-{i}", reports, env, ready, go, results)
                )
                for i in range(reporters)
            ]
            for process in processes:
                process.start()
            for _ in processes:
                ready.get(timeout=300)
            go.set()
            done = [results.get(timeout=600) for _ in processes]
            for process in processes:
                process.join(timeout=60)
            total = sum(n for *_, n in done)
            wall = max(end for _, _, end, _ in done) - min(start for _, start, _, _ in done)
            validated_start = time.perf_counter()
            for run, *_ in done:
                registry.wait(run, timeout_s=1200)
            drain = time.perf_counter() - validated_start
            counts = sum(
                1
                for run, *_ in done
                for c in registry.checkpoints(run)
                if c.validation_status == "VALIDATED"
            )
            rows.append(
                f"| {backend} | {reporters} | {total:,} | {total / wall:,.0f} | "
                f"{counts:,} validated, {drain:.1f} s after the last report |"
            )
            print(rows[-1], flush=True)
            service.stop()
        finally:
            ray.shutdown()
            registry.close()
            database.drop()
            os.environ.pop("CKVAL_DATABASE_URL", None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--runs", type=int, default=10, help="runs the checkpoints spread over")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--reporters", type=int, default=8)
    parser.add_argument("--reports", type=int, default=250, help="per reporter")
    parser.add_argument("--skip-registration", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.reporters, args.reports = [2_000], 5, 2, 5
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    header = (
        f"date={time.strftime('%Y-%m-%d')} cores={os.cpu_count()} "
        f"python={sys.version.split()[0]} runs={args.runs} repeats={args.repeats}"
    )
    print(header)
    best_rows = bench_best(args.backends, args.sizes, args.runs, args.repeats)
    text = "\n".join(
        [
            header,
            "",
            "best_checkpoints(k=10), 5 metrics per checkpoint, latencies in ms:",
            "",
            "| database | checkpoints | in the run | in-run median | in-run p95 "
            "| all-runs median | all-runs p95 | import rows/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *best_rows,
        ]
    )
    if not args.skip_registration:
        reg_rows = bench_registration(args.backends, args.reporters, args.reports)
        text += "\n".join(
            [
                "",
                "",
                f"registration through report() with {args.reporters} reporter processes "
                "(1 KB checkpoints, SYNC, validate_fn enqueued):",
                "",
                "| database | reporters | reports | acknowledged/s | validations |",
                "| --- | --- | --- | --- | --- |",
                *reg_rows,
            ]
        )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
