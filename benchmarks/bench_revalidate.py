"""Evaluations over history: queueing a revalidation of every stored checkpoint, running it
through the service, and what a live run's validation waits for meanwhile.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_revalidate.py            # 100 x 100, both
    PYTHONPATH=. .venv/bin/python benchmarks/bench_revalidate.py --smoke    # tiny, for CI
    CKVAL_TEST_POSTGRES_URL=postgresql+psycopg://u@host/db ...             # the server to use

Every database is new (SQLite in a temporary folder; PostgreSQL a new database on the
server, dropped afterwards) and holds RUNS finished runs of CHECKPOINTS stored checkpoints
each, imported in bulk. Every checkpoint points at one small shared folder without a
manifest, which a validation reads as a folder registered from outside training: the
no-op validate_fn reads nothing, so the figures are ckval's own costs.

* queue time: ``Registry.revalidate([every run], noop, validator=...)``, one job per
  stored checkpoint in one transaction, and the same call again, which finds every
  checkpoint queued and queues nothing. Each repeat queues under a validator name of its
  own, and its jobs are cancelled before the next (no service runs in this part).
* a live run's delay (one database, ``--service-on``): ``ray.init()`` on this machine's
  cores and the service with its default settings (default pools). A Client reports a
  1 KB checkpoint with a no-op validate_fn, and the time from report()'s return to
  Registry.wait(run) returning (its result committed) is taken ``--live-samples`` times,
  one report at a time: on the idle service, then right after the whole history is
  queued again (validator "history"), while that backlog runs.
* end to end: the rate of that backlog, from revalidate()'s return to the last of its
  first ``--end-to-end`` jobs SUCCEEDED (the live run's reports above run among them).
  Jobs left over are cancelled afterwards.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Database, command_line, load_average, pickle_by_value  # noqa: E402

QUEUE_TARGET_S = 2.0  # the queue time on PostgreSQL, 10,000 checkpoints
LIVE_TARGET_S = 1.0  # a live run's result, with a backlog, no later than without + this
LIVE_GAP_S = 0.3  # between a live run's reports: each one's job alone in the live queue


def noop_validate(checkpoint, config):
    """Reads nothing, does nothing: measures ckval, not the user."""
    return {"ok": 1.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database", choices=["postgresql", "sqlite", "both"], default="both",
        help="where the queue time is measured",
    )  # fmt: skip
    parser.add_argument(
        "--service-on", choices=["postgresql", "sqlite", "none"], default="postgresql",
        help="the database the end-to-end and live-run parts use (one of --database's)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--checkpoints-per-run", type=int, default=100)
    parser.add_argument(
        "--end-to-end", type=int, default=None, metavar="N",
        help="how many of the queued jobs the rate is taken over (default: all of them)",
    )  # fmt: skip
    parser.add_argument("--live-samples", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.checkpoints_per_run, args.end_to_end = 4, 10, None
        args.live_samples, args.repeats = 2, 2
    backends = ["postgresql", "sqlite"] if args.database == "both" else [args.database]
    if args.service_on != "none" and args.service_on not in backends:
        parser.error(f"--service-on {args.service_on} needs --database {args.service_on} or both")
    total = args.runs * args.checkpoints_per_run
    args.end_to_end = total if args.end_to_end is None else args.end_to_end
    if not 0 < args.end_to_end <= total:
        parser.error(f"--end-to-end: from 1 to every queued job ({total})")
    args.backends = backends
    return args


# ------------------------------------------------------------------ seeding
def shared_folder() -> str:
    """The one folder every seeded checkpoint points at: a file, no manifest."""
    folder = Path(tempfile.mkdtemp(prefix="bench-reval-ckpt-"))
    (folder / "weights.bin").write_bytes(b"\0" * 1024)
    return str(folder)


def seed(registry, runs: int, per_run: int, folder: str) -> list[str]:
    """``runs`` finished runs of ``per_run`` stored checkpoints each; returns their names."""
    names = [f"history-{r:03d}" for r in range(runs)]
    for name in names:
        run_id = registry.ledger.ensure_run(name, storage_root="/bench")
        batch = [
            {"report_index": i, "uri": folder, "metrics": {"loss": 1.0 / (i + 1)}}
            for i in range(per_run)
        ]
        registry.ledger.import_checkpoints(run_id, batch)
        registry.ledger.finish_run(name)
    registry.ledger.analyze()  # the planner's statistics after a bulk import
    return names


def cancel_all(registry, runs: list[str], reason: str) -> tuple[int, float]:
    """Cancels every QUEUED or RUNNING job of these runs; (how many, seconds)."""
    start = time.perf_counter()
    cancelled = sum(len(registry.cancel_jobs(run=run, reason=reason)) for run in runs)
    return cancelled, time.perf_counter() - start


# --------------------------------------------------------------- queue time
def time_queue(registry, runs: list[str], validator: str) -> dict[str, float]:
    """revalidate() over every run, then the same call again (nothing left to queue)."""
    start = time.perf_counter()
    queued = registry.revalidate(runs, noop_validate, validator=validator)
    first = time.perf_counter() - start
    start = time.perf_counter()
    again = registry.revalidate(runs, noop_validate, validator=validator)
    second = time.perf_counter() - start
    return {"first_s": first, "queued": len(queued), "again_s": second, "again": len(again)}


def bench_queue(registry, runs: list[str], repeats: int) -> list[dict[str, float]]:
    results = []
    for repeat in range(repeats):
        results.append(time_queue(registry, runs, validator=f"history-r{repeat}"))
        cancel_all(registry, runs, "benchmark: next repeat")
        print(f"  queue repeat {repeat}: {results[-1]}", flush=True)
    return results


# ------------------------------------------------------------- the service
def to_epoch(moment: dt.datetime) -> float:
    return moment.replace(tzinfo=moment.tzinfo or dt.timezone.utc).timestamp()


def live_samples(
    registry, run: str, count: int, scratch: Path, backlog: bool = False
) -> list[dict]:
    """``count`` reports of a live run, one at a time: report() returned -> wait() returned,
    and -> the job's claim, start and finish; with ``backlog``, how many jobs were still
    QUEUED after each sample (the backlog was still there)."""
    from ray.train import Checkpoint

    from trainer_integration import Client

    client = Client(run)
    samples = []
    for index in range(count):
        folder = scratch / f"{run}-{index}"
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"\1" * 1024)
        report_index = client.report(
            {"loss": 1.0}, Checkpoint.from_directory(str(folder)), validate_fn=noop_validate
        )
        returned = time.time()
        registry.wait(run, timeout_s=300, poll_s=0.02)
        waited = time.time() - returned
        [job] = [j for j in registry.validations(run) if j.report_index == report_index]
        assert job.status == "SUCCEEDED", (job.status, job.error_message)
        attempt = job.attempt_history[-1]
        sample = {
            "wait_s": waited,
            "claimed_s": to_epoch(attempt.claimed_at) - returned,
            "started_s": to_epoch(attempt.started_at) - returned,
            "finished_s": to_epoch(job.finished_at) - returned,
        }
        if backlog:
            sample["backlog_queued"] = registry.job_counts().get("QUEUED", 0)
        samples.append(sample)
        time.sleep(LIVE_GAP_S)
    client.close()
    return samples


def background_succeeded(registry, live_runs: list[str]) -> int:
    """SUCCEEDED jobs of the namespace, less the live runs' own."""
    total = registry.job_counts().get("SUCCEEDED", 0)
    return total - sum(registry.job_counts(run).get("SUCCEEDED", 0) for run in live_runs)


def wait_for_backlog(registry, count: int, live_runs: list[str]) -> None:
    deadline = time.monotonic() + 1800
    while background_succeeded(registry, live_runs) < count:
        assert time.monotonic() < deadline, f"{count} jobs of the backlog not done in 30 min"
        time.sleep(0.5)


def backlog_figures(registry, queued_at: float, count: int) -> dict:
    """The first ``count`` jobs of "history" to succeed: the rate from revalidate()'s
    return (over the first 1,000 too), and where each job's time went."""
    jobs = [j for j in registry.list_jobs(statuses=["SUCCEEDED"]) if j.validator == "history"]
    jobs = sorted(jobs, key=lambda j: j.finished_at)[:count]
    attempts = [job.attempt_history[-1] for job in jobs]
    finished = [to_epoch(a.finished_at) for a in attempts]
    elapsed = finished[-1] - queued_at
    busy = sum((a.finished_at - a.claimed_at).total_seconds() for a in attempts)
    first = min(1000, count)
    return {
        "elapsed_s": elapsed,
        "per_s": count / elapsed,
        "first_per_s": first / (finished[first - 1] - queued_at),
        "first_count": first,
        "first_s": finished[0] - queued_at,
        "claim_to_start_s": statistics.median(
            (a.started_at - a.claimed_at).total_seconds() for a in attempts
        ),
        "start_to_finish_s": statistics.median(
            (a.finished_at - a.started_at).total_seconds() for a in attempts
        ),
        "mean_claimed": busy / elapsed,
        "failed": registry.job_counts().get("FAILED", 0),
    }


def bench_service(url: str, runs: list[str], args) -> dict:
    """ray.init() on this machine, the service with default settings, on ``url``."""
    import ray

    from validation_service.config import ckval_env, get_settings
    from validation_service.registry.registry import Registry
    from validation_service.service import ValidationService

    os.environ["CKVAL_DATABASE_URL"] = url
    pickle_by_value(__name__)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ckval_env()})
    settings = get_settings()
    service = ValidationService.start(settings=settings)
    registry = Registry(url)
    scratch = Path(tempfile.mkdtemp(prefix="bench-reval-live-"))
    try:
        live_samples(registry, "live-warmup", 3, scratch)  # untimed: workers started
        idle = live_samples(registry, "live-idle", args.live_samples, scratch)
        job_ids = registry.revalidate(runs, noop_validate, validator="history")
        queued_at = time.time()
        busy = live_samples(registry, "live-backlog", args.live_samples, scratch, backlog=True)
        wait_for_backlog(registry, args.end_to_end, ["live-warmup", "live-idle", "live-backlog"])
        throughput = backlog_figures(registry, queued_at, args.end_to_end)
        throughput["queued"] = len(job_ids)
        throughput["cancelled"], throughput["cancel_s"] = cancel_all(
            registry, runs, "benchmark: end-to-end slice done"
        )
        print(f"  end to end: {throughput}", flush=True)
        return {
            "idle": idle,
            "busy": busy,
            "throughput": throughput,
            "pools": f"default pool size {settings.default_pool_size}, pools {settings.pools}",
            "cpus": int(ray.cluster_resources().get("CPU", 0)),
        }
    finally:
        service.stop()
        registry.close()
        ray.shutdown()


# --------------------------------------------------------------- databases
def bench_database(backend: str, args, folder: str, with_service: bool) -> dict:
    from validation_service.registry.registry import Registry

    database = Database(backend, "bench-reval-")
    try:
        registry = Registry(database.url, upgrade=True)
        start = time.perf_counter()
        runs = seed(registry, args.runs, args.checkpoints_per_run, folder)
        seeded_s = time.perf_counter() - start
        print(f"{backend}: seeded {len(runs)} runs in {seeded_s:.1f} s", flush=True)
        result = {"queue": bench_queue(registry, runs, args.repeats), "seed_s": seeded_s}
        registry.close()
        if with_service:
            result["service"] = bench_service(database.url, runs, args)
        return result
    finally:
        database.drop()


# ------------------------------------------------------------------ tables
def queue_row(backend: str, runs: int, per_run: int, repeats: list[dict]) -> str:
    firsts = [r["first_s"] for r in repeats]
    agains = [r["again_s"] for r in repeats]
    queued = repeats[0]["queued"]
    median = statistics.median(firsts)
    verdict = "" if backend != "postgresql" else ("met" if median < QUEUE_TARGET_S else "missed")
    return (
        f"| {backend} | {runs} x {per_run} | {queued:,} | {median:.3f} "
        f"| {', '.join(f'{v:.3f}' for v in firsts)} | {queued / median:,.0f} "
        f"| {statistics.median(agains):.3f} | {max(r['again'] for r in repeats)} | {verdict} |"
    )


def live_row(label: str, samples: list[dict], key: str) -> str:
    values = [s[key] for s in samples]
    return (
        f"| {label} | {len(values)} | {statistics.median(values):.3f} "
        f"| {min(values):.3f} | {max(values):.3f} | {', '.join(f'{v:.2f}' for v in values)} |"
    )


def service_tables(service: dict, slice_size: int) -> list[str]:
    t = service["throughput"]
    idle, busy = service["idle"], service["busy"]
    lines = [
        f"Service: {service['cpus']} CPUs in Ray, {service['pools']}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| jobs queued by revalidate() (validator history) | {t['queued']:,} |",
        f"| **validations/s, end to end, {slice_size:,} jobs** | **{t['per_s']:.1f}** "
        f"({t['elapsed_s']:.1f} s) |",
        f"| validations/s, the first {t['first_count']:,} | {t['first_per_s']:.1f} |",
        f"| revalidate() returned -> first job SUCCEEDED (s) | {t['first_s']:.3f} |",
        f"| per job, claimed -> validate_fn started: median (s) | {t['claim_to_start_s']:.3f} |",
        f"| per job, started -> finished: median (s) | {t['start_to_finish_s']:.3f} |",
        f"| jobs claimed at once, mean | {t['mean_claimed']:.2f} |",
        f"| jobs FAILED | {t['failed']} |",
        f"| left over, cancelled afterwards: jobs, seconds | {t['cancelled']:,}, "
        f"{t['cancel_s']:.2f} |",
        "",
        "A live run's validation: report() returned -> Registry.wait(run) returned (s)",
        "",
        "| live run | samples | median | min | max | each, in report order |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        live_row("idle service, no backlog", idle, "wait_s"),
        live_row("backlog running", busy, "wait_s"),
        "",
        "The same reports: report() returned -> the job's claim, validate_fn's start, the "
        "job's finished_at (registry timestamps, s)",
        "",
        "| live run | samples | median | min | max | each, in report order |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, what in (
        ("claimed_s", "claimed"),
        ("started_s", "started"),
        ("finished_s", "finished"),
    ):
        lines.append(live_row(f"idle, {what}", idle, key))
        lines.append(live_row(f"backlog, {what}", busy, key))
    queued_left = min(s["backlog_queued"] for s in busy)
    difference = statistics.median(s["wait_s"] for s in busy) - statistics.median(
        s["wait_s"] for s in idle
    )
    verdict = "met" if difference <= LIVE_TARGET_S else "missed"
    lines += [
        "",
        f"With the backlog, median - without: {difference:+.3f} s (target <= "
        f"+{LIVE_TARGET_S:.0f} s: {verdict}); at least {queued_left:,} jobs were still "
        "QUEUED after every sample.",
    ]
    return lines


def render(args, results: dict[str, dict], load_before: str) -> str:
    import platform

    import ray

    lines = [
        f"- command: {command_line()}",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPU cores ({platform.machine()}); python "
        f"{platform.python_version()}, ray {ray.__version__}",
        f"- load average before {load_before}, after {load_average()}",
        "",
        "Queue time: revalidate(every run, noop, validator=...) in one transaction (s)",
        "",
        "| database | runs x checkpoints | jobs queued | median (s) | each repeat (s) "
        "| jobs/s | again, all queued: median (s) | queued again | target < 2 s |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for backend, result in results.items():
        lines.append(queue_row(backend, args.runs, args.checkpoints_per_run, result["queue"]))
    lines.append("")
    lines.append("Seeding (bulk import, untimed above): " + ", ".join(
        f"{backend} {result['seed_s']:.1f} s" for backend, result in results.items()
    ))  # fmt: skip
    for backend, result in results.items():
        if "service" in result:
            lines += ["", f"Service on {backend}.", ""]
            lines += service_tables(result["service"], args.end_to_end)
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    load_before = load_average()
    os.environ["CKVAL_HOME"] = tempfile.mkdtemp(prefix="ckval-bench-reval-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for name in ("CKVAL_DATABASE_URL", "CKVAL_STORAGE", "CKVAL_RAY_ADDRESS", "RAY_ADDRESS"):
        os.environ.pop(name, None)
    folder = shared_folder()
    results = {
        backend: bench_database(backend, args, folder, with_service=backend == args.service_on)
        for backend in args.backends
    }
    text = render(args, results, load_before)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
