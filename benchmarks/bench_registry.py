"""Registry scale: best_checkpoints(k=10) latency by size, and registration throughput.

    .venv/bin/python benchmarks/bench_registry.py                  # 10k, 100k, 1M; both databases
    .venv/bin/python benchmarks/bench_registry.py --sizes 10000 100000 --backends sqlite
    .venv/bin/python benchmarks/bench_registry.py --smoke          # tiny sizes, for CI

Each size is loaded into a fresh database (SQLite in a temp folder; PostgreSQL as a new
database on CKVAL_TEST_POSTGRES_URL's server, dropped afterwards) with 5 metrics per
checkpoint, then best_checkpoints(k=10) is timed within one run and across all runs.
Registration throughput runs 8 reporter processes calling Client.report() (1 KB
checkpoint, SYNC upload, a validate_fn enqueued) against the running service, and counts
reports acknowledged per second, twice per database: "concurrent", with the service
validating while the reports arrive (on one machine, everything shares its cores), and
"deferred", with the service holding no validation slots during the window (as when the
validations run on other nodes), after which it validates the backlog. It also prints
the CPU time per report: the reporters' own, the machine's, and by process name.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Database  # noqa: E402

METRICS = ("accuracy", "loss", "f1", "precision", "recall")


def load(registry, size: int, runs: int) -> float:
    """Imports `size` checkpoints spread over `runs` runs; returns the seconds it took."""
    rng = random.Random(0)
    per_run = size // runs
    start = time.perf_counter()
    for r in range(runs):
        run_id = registry.ledger.ensure_run(f"run-{r}", storage_root="/bench")
        for first in range(0, per_run, 20_000):
            batch = [
                {
                    "report_index": i,
                    "uri": f"/bench/run-{r}/checkpoint_{i:07d}",
                    "metrics": {name: rng.random() for name in METRICS},
                }
                for i in range(first, min(first + 20_000, per_run))
            ]
            registry.ledger.import_checkpoints(run_id, batch)
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
            database = Database(backend, "bench-reg-")
            try:
                registry = Registry(database.url, upgrade=True)
                load_s = load(registry, size, runs)
                registry.ledger.analyze()
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
    start, cpu = time.perf_counter(), time.process_time()
    for checkpoint in checkpoints[1:]:
        client.report({"loss": 0.5}, checkpoint, validate_fn=noop_validate)
    end, cpu = time.perf_counter(), time.process_time() - cpu
    results.put((run, start, end, reports - 1, cpu))


MODES = {
    "concurrent": "the service validates while the reports arrive (all on the same 2 cores)",
    "deferred": "the service runs with no validation slots while the reports arrive, then "
    "validates the backlog",
}


def bench_registration(backends: list[str], reporters: int, reports: int) -> list[str]:
    import ray

    from validation_service.config import ckval_env
    from validation_service.registry.registry import Registry

    rows = []
    for backend in backends:
        database = Database(backend, "bench-reg-")
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
            for mode in MODES:
                rows.append(_registration_row(registry, backend, mode, reporters, reports))
        finally:
            ray.shutdown()
            registry.close()
            database.drop()
            os.environ.pop("CKVAL_DATABASE_URL", None)
    return rows


def _registration_row(registry, backend: str, mode: str, reporters: int, reports: int) -> str:
    """One measured window: `reporters` processes each report `reports` checkpoints."""
    import ray

    from validation_service.config import ckval_env
    from validation_service.service import ValidationService

    # "deferred": no validation slots while reporting (validations run elsewhere, later).
    service = ValidationService.start(default_pool_size=0 if mode == "deferred" else 4)
    env = {
        **ckval_env(),
        "CKVAL_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }
    context = multiprocessing.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(
            target=reporter, args=(f"{mode}-reporter-{i}", reports, env, ready, go, results)
        )
        for i in range(reporters)
    ]
    for process in processes:
        process.start()
    runs = [ready.get(timeout=300) for _ in processes]
    if mode == "concurrent":
        for run in runs:  # their first validations: Ray's workers are started and warm
            registry.wait(run, timeout_s=300)
    machine_cpu, process_cpu = _machine_cpu_seconds(), _process_cpu_seconds()
    go.set()
    done = [results.get(timeout=600) for _ in processes]
    machine_cpu = _machine_cpu_seconds() - machine_cpu
    breakdown = _cpu_breakdown(process_cpu, _process_cpu_seconds())
    for process in processes:
        process.join(timeout=60)
    total = sum(n for _, _, _, n, _ in done)
    wall = max(end for _, _, end, _, _ in done) - min(start for _, start, _, _, _ in done)
    reporter_ms = 1000 * sum(cpu for *_, cpu in done) / total
    machine_ms = 1000 * machine_cpu / total
    validated_while_reporting = _validated(registry, runs)
    if mode == "deferred":
        service.stop()
        service = ValidationService.start(default_pool_size=4)
    drain_start = time.perf_counter()
    for run in runs:
        registry.wait(run, timeout_s=1200)
    drain = time.perf_counter() - drain_start
    service.stop()
    row = (
        f"| {backend} | {mode} | {reporters} | {total:,} | {total / wall:,.0f} | "
        f"{reporter_ms:.2f} | {machine_ms:.2f} | {validated_while_reporting:,} | "
        f"{_validated(registry, runs):,} validated, the last {drain:.1f} s after the last "
        "report |"
    )
    print(row, flush=True)
    print(
        f"  CPU ms per report while reporting ({backend}, {mode}): "
        + ", ".join(f"{name} {1000 * cpu / total:.2f}" for name, cpu in breakdown),
        flush=True,
    )
    return row


def _validated(registry, runs: list[str]) -> int:
    return sum(
        1
        for run in runs
        for checkpoint in registry.checkpoints(run)
        if checkpoint.validation_status == "VALIDATED"
    )


def _machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used (Linux /proc/stat), else 0."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, *_ = (int(x) for x in fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (process name, CPU seconds used so far), from /proc (Linux), else empty."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    usage = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        usage[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return usage


def _cpu_breakdown(before: dict, after: dict) -> list[tuple[str, float]]:
    """CPU seconds used between two snapshots by the processes alive at the second,
    summed by process name (Ray names its workers after what they run), largest first."""
    by_name: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        used = cpu - before.get(pid, (name, 0.0))[1]
        if used > 0:
            by_name[name] = by_name.get(name, 0.0) + used
    return sorted(by_name.items(), key=lambda item: -item[1])[:8]


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
        # The smoke run registers on one database: the other takes the same code path.
        backends = args.backends[:1] if args.smoke else args.backends
        reg_rows = bench_registration(backends, args.reporters, args.reports)
        text += "\n".join(
            [
                "",
                "",
                f"registration through report() with {args.reporters} reporter processes "
                "(1 KB checkpoints, SYNC, validate_fn enqueued):",
                "",
                "| database | validations | reporters | reports | acknowledged/s "
                "| reporter CPU ms/report | machine CPU ms/report | validated while reporting "
                "| validations |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *reg_rows,
            ]
        )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
