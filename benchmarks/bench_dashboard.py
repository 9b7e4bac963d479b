"""Dashboard and /metrics latency over a large registry: 1k runs, 100k checkpoints.

    .venv/bin/python benchmarks/bench_dashboard.py                   # SQLite and PostgreSQL
    .venv/bin/python benchmarks/bench_dashboard.py --backends sqlite --repeats 50
    .venv/bin/python benchmarks/bench_dashboard.py --smoke           # tiny, for the tests

Each database is fresh (SQLite in a temp folder; PostgreSQL a new database on
CKVAL_TEST_POSTGRES_URL's server, dropped afterwards), migrated by the Registry, then
filled with SQLAlchemy Core bulk inserts: every run has --checkpoints-per-run checkpoints
with a reported loss and a validated accuracy, and one validation job each with its
attempt. Most jobs SUCCEEDED; 1 in 100 FAILED with a traceback; the newest 5 jobs of
one run in 20 are QUEUED or RUNNING, so the pages poll and /metrics sees live leases.
Then each endpoint is requested through the real app (FastAPI's TestClient: routing,
registry queries, rendering and JSON; no network), --warmup times unmeasured and
--repeats times measured, and the median and 95th percentile of the wall time are printed
as a Markdown table, with whether the median is under the 100 ms budget. "API CPU ms" is
the CPU time of this process (the app, and SQLite's work, which runs inside it; not the
PostgreSQL server's): on a busy machine it shows the cost that the wall time hides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    command_line,
    fresh_registries,
    load_average,
    time_get,
)

BUDGET_MS = 100.0
BATCH = 5_000


def load(registry, runs: int, per_run: int) -> float:
    """Bulk-inserts the runs, checkpoints, metric values, jobs and attempts; returns seconds."""
    from validation_service.jobs import JobStatus, MetricSource, ValidationStatus
    from validation_service.registry.models import (
        Checkpoint,
        MetricValue,
        Run,
        ValidationAttempt,
        ValidationJob,
    )
    from validation_service.registry.transitions import idempotency_key

    started = time.perf_counter()
    origin = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=30)
    tables = {
        "runs": Run.__table__,
        "checkpoints": Checkpoint.__table__,
        "values": MetricValue.__table__,
        "jobs": ValidationJob.__table__,
        "attempts": ValidationAttempt.__table__,
    }
    rows: dict[str, list[dict]] = {name: [] for name in tables}

    def flush(conn, force: bool = False) -> None:
        if not force and max(len(batch) for batch in rows.values()) < BATCH:
            return
        for name in tables:  # parents first: the foreign keys hold at every flush
            if rows[name]:
                conn.execute(tables[name].insert(), rows[name])
                rows[name].clear()

    checkpoint_id = 0
    with registry.engine.begin() as conn:
        for run_id in range(1, runs + 1):
            created = origin + dt.timedelta(minutes=30 * run_id / runs * 60)
            live = run_id % 20 == 0
            rows["runs"].append(
                {
                    "id": run_id,
                    "name": f"run-{run_id:05d}",
                    "namespace": "default",
                    "storage_root": f"/bench/run-{run_id:05d}",
                    "created_at": created,
                    "status": "RUNNING" if live else "FINISHED",
                    "tags": {"team": f"t{run_id % 7}"},
                }
            )
            pool = "A10G" if run_id % 2 else "CPU"
            for index in range(per_run):
                checkpoint_id += 1
                at = created + dt.timedelta(seconds=30 * index)
                loss = 2.0 / (1 + index) + (run_id % 13) / 100
                accuracy = 1 - loss / 3
                pending = live and index >= per_run - 5
                failed = not pending and checkpoint_id % 100 == 0
                status = (
                    (JobStatus.RUNNING if index == per_run - 5 else JobStatus.QUEUED)
                    if pending
                    else JobStatus.FAILED
                    if failed
                    else JobStatus.SUCCEEDED
                )
                validated = status is JobStatus.SUCCEEDED
                rows["checkpoints"].append(
                    {
                        "id": checkpoint_id,
                        "run_id": run_id,
                        "report_index": index,
                        "step": 100 * index,
                        "epoch": index,
                        "uri": f"/bench/run-{run_id:05d}/checkpoint_{index:06d}",
                        "size_bytes": 1 << 20,
                        "manifest_sha256": None,
                        "created_at": at,
                        "reported_metrics": {"loss": loss},
                        "validated_metrics": {"accuracy": accuracy} if validated else None,
                        "metrics": {"loss": loss, **({"accuracy": accuracy} if validated else {})},
                        "validation_status": (
                            ValidationStatus.VALIDATED
                            if validated
                            else ValidationStatus.FAILED
                            if failed
                            else ValidationStatus.PENDING
                        ).value,
                        "deleted_at": None,
                    }
                )
                value = {"checkpoint_id": checkpoint_id, "run_id": run_id, "effective": True}
                rows["values"].append(
                    {**value, "name": "loss", "source": MetricSource.REPORTED.value, "value": loss}
                )
                if validated:
                    rows["values"].append(
                        {
                            **value,
                            "name": "accuracy",
                            "source": MetricSource.VALIDATED.value,
                            "value": accuracy,
                        }
                    )
                claimed = at + dt.timedelta(seconds=0.2 + (index % 7) / 4)
                finished = claimed + dt.timedelta(seconds=1 + (index % 50) * 2.5)
                running = status is JobStatus.RUNNING
                ran = status is not JobStatus.QUEUED
                rows["jobs"].append(
                    {
                        "id": checkpoint_id,
                        "checkpoint_id": checkpoint_id,
                        "run_id": run_id,
                        "idempotency_key": idempotency_key(run_id, index),
                        "validate_fn_ref": "bench:validate",
                        "validate_fn_pickle": None,
                        "validate_fn_name": "validate",
                        "validate_config": None,
                        "executor_kind": "ray_task",
                        "resources": {"num_gpus": 1} if pool == "A10G" else {},
                        "pool": pool,
                        "priority": 0,
                        "status": status.value,
                        "attempts": 1 if ran else 0,
                        "max_attempts": 3,
                        "attempts_before_retry": 0,
                        "not_before": at,
                        "lease_owner": "bench/1" if running else None,
                        "lease_token": 1 if ran else 0,
                        "lease_expires_at": (
                            dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
                            if running
                            else None
                        ),
                        "timeout_s": None,
                        "retry_on_timeout": False,
                        "error_type": "ValueError" if failed else None,
                        "error_message": "bad checkpoint" if failed else None,
                        "error_traceback": "Traceback (most recent call last):\nValueError"
                        if failed
                        else None,
                        "result_metrics": {"accuracy": accuracy} if validated else None,
                        "created_at": at,
                        "updated_at": finished if ran and not running else claimed,
                        "started_at": claimed if ran else None,
                        "finished_at": finished if ran and not running else None,
                    }
                )
                if ran:
                    rows["attempts"].append(
                        {
                            "job_id": checkpoint_id,
                            "attempt": 1,
                            "lease_token": 1,
                            "lease_owner": "bench/1",
                            "status": status.value,
                            "claimed_at": claimed,
                            "started_at": claimed,
                            "finished_at": None if running else finished,
                            "node_id": "node-1",
                            "worker_pid": 1000 + index,
                            "error_message": "bad checkpoint" if failed else None,
                        }
                    )
                flush(conn)
        flush(conn, force=True)
        if conn.dialect.name == "postgresql":
            # Explicit ids were inserted: move the sequences past them for later inserts.
            for name in ("runs", "checkpoints", "validation_jobs", "validation_attempts"):
                conn.exec_driver_sql(
                    f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                    f"(SELECT max(id) FROM {name}))"
                )
    if registry.engine.dialect.name == "postgresql":
        # What autovacuum does after a bulk insert: the visibility map lets the counts run
        # as index-only scans.
        with registry.db.autocommit() as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    else:
        registry.ledger.analyze()
    return time.perf_counter() - started


def endpoints(runs: int) -> list[tuple[str, str]]:
    live = f"run-{20 * max(1, runs // 40):05d}"  # a run with jobs still queued
    other = f"run-{max(1, runs // 3):05d}"
    last_page = max(1, (runs + 49) // 50)
    return [
        ("runs page (HTML), page 1", "/ui/"),
        ("runs data, page 1", "/ui/api/runs"),
        (f"runs data, page {last_page}, best loss", f"/ui/api/runs?page={last_page}&metric=loss"),
        ("run page (HTML)", f"/ui/runs/{live}"),
        ("run data", f"/ui/api/runs/{live}"),
        (
            "compare page (HTML), 3 runs",
            f"/ui/compare?runs={live},{other},run-00001&metric=accuracy",
        ),
        ("compare data, 3 runs", f"/ui/api/compare?runs={live},{other},run-00001&metric=accuracy"),
        ("/metrics", "/metrics"),
    ]


def time_endpoints(registry, runs: int, warmup: int, repeats: int) -> list[dict]:
    from fastapi.testclient import TestClient

    from validation_service.api import create_app
    from validation_service.config import Settings

    app = create_app(Settings(service_name="ckval-bench-none"), registry)
    results = []
    with TestClient(app, base_url="http://localhost") as client:
        # The first scrape buckets every job so far in SQL; later ones read changes only.
        start, start_cpu = time.perf_counter(), time.process_time()
        response = client.get("/metrics")
        first = (time.perf_counter() - start) * 1000
        first_cpu = (time.process_time() - start_cpu) * 1000
        assert response.status_code == 200, response.text[:300]
        results.append(
            {
                "endpoint": "/metrics, first scrape (one sample)",
                "url": "/metrics",
                "median": first,
                "p95": first,
                "cpu": first_cpu,
                "bytes": len(response.content),
            }
        )
        for name, url in endpoints(runs):
            timed = time_get(client, url, warmup, repeats)
            results.append({"endpoint": name, "url": url, **timed})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--checkpoints-per-run", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="20 runs x 10, 3 repeats")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.checkpoints_per_run, args.warmup, args.repeats = 20, 10, 1, 3
    os.environ.setdefault("CKVAL_HOME", tempfile.mkdtemp(prefix="bench-dash-home-"))

    load_before = load_average()
    lines = [
        f"    {command_line()}",
        "",
        "| database | endpoint | median ms | p95 ms | API CPU ms (median) | bytes "
        "| median under 100 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for backend, registry in fresh_registries(args.backends, "bench-dash-"):
        seconds = load(registry, args.runs, args.checkpoints_per_run)
        total = args.runs * args.checkpoints_per_run
        notes.append(
            f"- {backend}: {total:,} checkpoints in {args.runs:,} runs loaded in {seconds:.1f} s"
        )
        print(notes[-1], file=sys.stderr, flush=True)
        for row in time_endpoints(registry, args.runs, args.warmup, args.repeats):
            ok = "yes" if row["median"] < BUDGET_MS else "**no**"
            if "first scrape" in row["endpoint"]:
                ok = "(once per process)"
            lines.append(
                f"| {backend} | {row['endpoint']} | {row['median']:.1f} | {row['p95']:.1f} "
                f"| {row['cpu']:.1f} | {row['bytes']:,} | {ok} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", *notes, f"- load average before {load_before}, after {load_average()}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
