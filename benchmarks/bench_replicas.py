"""Service replicas on PostgreSQL: dispatch throughput and claim-to-start latency with 1, 2
and 3 replicas, with and without Ray's task start.

    .venv/bin/python benchmarks/bench_replicas.py                  # full (about 5 minutes)
    .venv/bin/python benchmarks/bench_replicas.py --smoke          # tiny sizes, for CI
    CKVAL_BENCH_POSTGRES_URL=postgresql+psycopg://u@host/db ...    # the server to use

Two measures, each on a fresh database per replica count:

* queue alone (no Ray): N processes run ckval's claim and finish (the scheduler's two
  transactions: FOR UPDATE SKIP LOCKED under the pool's claim lock, then the fenced
  finish that merges the metrics) on jobs queued beforehand, as fast as they can. This is
  the figure to set next to PostgreSQL job queues'.
* the whole service (Ray): `ray.init()` in this script, then a service with N replicas
  validates no-op checkpoints reported by a Client: validations merged per second, the
  claim-to-start latency (a claim committed -> the validate_fn running in a Ray worker)
  and report-to-claim (a report committed -> its claim: the LISTEN/NOTIFY wake-up; the
  replicas poll every 5 s here, so polling cannot be what claims), both measured on 30
  reports 0.3 s apart, so that each reaches an idle service. The first round of
  each count starts from a new service (cold workers); the later ones run on the same,
  warm service; the table gives the warm rounds' median and the cold round apart.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, pickle_by_value, run_description  # noqa: E402

# The latency round: reports this far apart, each to an idle service.
PACED_REPORTS = 30
PACED_GAP_S = 0.3
POSTGRES_URL = os.environ.get(
    "CKVAL_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def noop_validate(checkpoint, config):
    """Does nothing: measures the service, not the user."""
    return {"ok": 1.0}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ------------------------------------------------------------------ databases
def fresh_database() -> str:
    import sqlalchemy as sa

    from validation_service.registry.registry import Registry

    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"ckval_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = sa.engine.make_url(POSTGRES_URL).set(database=name)
    url = url.render_as_string(hide_password=False)
    Registry(url, upgrade=True).close()
    return url


def drop_database(url: str) -> None:
    import sqlalchemy as sa

    name = sa.engine.make_url(url).database
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
            {"d": name},
        )
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


# ---------------------------------------------------------- the queue alone
def queue_jobs(url: str, count: int) -> None:
    from validation_service.registry.registry import Registry
    from validation_service.request import ValidationRequest

    registry = Registry(url)
    run_id = registry.ledger.ensure_run("bench-queue", storage_root="/bench")
    request = ValidationRequest(
        executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
    )
    for index in range(count):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/bench/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"loss": 1.0},
            job=request,
        )
    registry.close()


def claim_and_finish(url: str, owner: str, cap: int, start, done) -> None:
    """One replica's two transactions, in a loop, until the queue is empty."""
    from validation_service.registry.records import JobOutcome
    from validation_service.registry.registry import Registry

    registry = Registry(url)
    queue = registry.job_queue
    start.wait()
    finished = 0
    while True:
        claimed = queue.claim_due_jobs(owner, {"CPU": cap}, lease_s=60, max_jobs=cap)
        if not claimed:
            if not queue.due_pools():
                break
            continue
        for job in claimed:
            outcome = JobOutcome(succeeded=True, metrics={"ok": 1.0})
            finished += queue.finish_job(job.job_id, job.lease_token, outcome)
    done.put(finished)
    registry.close()


def bench_queue_alone(replicas: int, jobs: int, cap: int) -> dict[str, float]:
    url = fresh_database()
    try:
        queue_jobs(url, jobs)
        context = multiprocessing.get_context("spawn")
        start, done = context.Event(), context.Queue()
        processes = [
            context.Process(target=claim_and_finish, args=(url, f"bench-{i}/1", cap, start, done))
            for i in range(replicas)
        ]
        for process in processes:
            process.start()
        time.sleep(3.0)  # every process has imported ckval and opened its engine
        began = time.perf_counter()
        start.set()
        finished = sum(done.get(timeout=600) for _ in processes)
        elapsed = time.perf_counter() - began
        for process in processes:
            process.join()
        assert finished == jobs, (finished, jobs)
        return {"jobs_per_s": jobs / elapsed}
    finally:
        drop_database(url)


# --------------------------------------------------------- the whole service
def report_round(
    client, registry, run: str, count: int, scratch: Path, gap_s: float = 0.0
) -> dict[str, float]:
    """``count`` reports of 1 KB checkpoints, back to back (throughput) or ``gap_s`` apart
    (latency: each one reaches an idle service)."""
    from ray.train import Checkpoint

    for index in range(count):
        directory = scratch / f"{run}-{index}"
        directory.mkdir()
        (directory / "w").write_bytes(b"x" * 1024)
        checkpoint = Checkpoint.from_directory(str(directory))
        client.report({"loss": 1.0}, checkpoint, validate_fn=noop_validate)
        time.sleep(gap_s)
    registry.wait(run, timeout_s=900)
    jobs = registry.validations(run)
    attempts = [job.attempt_history[-1] for job in jobs]
    assert all(a.status == "SUCCEEDED" for a in attempts)
    first_claim = min(a.claimed_at for a in attempts)
    last_end = max(a.finished_at for a in attempts)
    return {
        "per_s": count / (last_end - first_claim).total_seconds(),
        "claim_to_start": [(a.started_at - a.claimed_at).total_seconds() for a in attempts],
        "report_to_claim": [
            (job.attempt_history[0].claimed_at - job.created_at).total_seconds() for job in jobs
        ],
    }


def bench_service(replicas: int, count: int, rounds: int, cap: int) -> list[dict]:
    from trainer_integration import Client
    from validation_service.registry.registry import Registry
    from validation_service.service import ValidationService

    url = fresh_database()
    name = f"bench-ha-{replicas}-{uuid.uuid4().hex[:4]}"
    os.environ.update(CKVAL_DATABASE_URL=url, CKVAL_SERVICE_NAME=name)
    handle = ValidationService.start(replicas=replicas, pools={"CPU": cap}, poll_interval_s=5.0)
    registry = Registry(url)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    try:
        deadline = time.monotonic() + 120
        while not all(r["alive"] for r in handle.status()["replicas"]):
            assert time.monotonic() < deadline, "the replicas did not start"
            time.sleep(0.2)
        results = []
        for round_index in range(rounds):
            run = f"bench-{replicas}-{round_index}"
            results.append(report_round(Client(run), registry, run, count, scratch))
        run = f"bench-{replicas}-paced"
        paced = report_round(Client(run), registry, run, PACED_REPORTS, scratch, PACED_GAP_S)
        return results, paced
    finally:
        handle.stop()
        registry.close()
        drop_database(url)


# ------------------------------------------------------------------- report
def service_row(replicas: int, measured: tuple[list[dict], dict]) -> str:
    ms = 1000.0
    rounds, paced = measured
    cold, warm = rounds[0], rounds[1:] or rounds[:1]
    starts, claims = paced["claim_to_start"], paced["report_to_claim"]
    return (
        f"| {replicas} | {statistics.median(r['per_s'] for r in warm):.1f} "
        f"| {cold['per_s']:.1f} "
        f"| {statistics.median(starts) * ms:.1f} / {percentile(starts, 0.95) * ms:.1f} "
        f"| {statistics.median(claims) * ms:.1f} / {percentile(claims, 0.95) * ms:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--queue-jobs", type=int, default=3000)
    parser.add_argument("--reports", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap", type=int, default=8, help="the CPU pool's cluster-wide cap")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.replicas, args.queue_jobs, args.reports, args.rounds = [1, 2], 60, 12, 2

    load = load_average()
    os.environ["CKVAL_HOME"] = tempfile.mkdtemp(prefix="ckval-bench-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["CKVAL_KEEP_WARM"] = "0"
    queue_rows = [
        f"| {n} | {bench_queue_alone(n, args.queue_jobs, args.cap)['jobs_per_s']:.0f} |"
        for n in args.replicas
    ]

    import ray

    from validation_service.config import ckval_env

    pickle_by_value(__name__)
    ray.init(
        num_cpus=2 * args.cap,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ckval_env()},
    )
    service_rows = [
        service_row(n, bench_service(n, args.reports, args.rounds, args.cap)) for n in args.replicas
    ]
    description = run_description(load)
    ray.shutdown()

    header = "\n".join(f"- {key}: {value}" for key, value in description.items())
    text = "\n".join(
        [
            header,
            f"- sizes: {args.queue_jobs} queued jobs (queue alone); {args.reports} reports x "
            f"{args.rounds} rounds per replica count (service); CPU pool cap {args.cap}",
            "",
            "Queue alone (no Ray): claim + fenced finish by N processes",
            "",
            "| replicas | jobs claimed, finished and merged per second |",
            "| --- | --- |",
            *queue_rows,
            "",
            "Whole service (Ray task per validation): no-op validations",
            "",
            "| replicas | validations/s, warm (median of rounds) | validations/s, cold round "
            f"| claim -> validate_fn started, ms (median / p95; {PACED_REPORTS} reports "
            f"{PACED_GAP_S} s apart) | report -> claim, ms (median / p95; the same) |",
            "| --- | --- | --- | --- | --- |",
            *service_rows,
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
