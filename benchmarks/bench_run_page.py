"""The dashboard's run page of one wide run: 200 checkpoints x 1000 metrics.

    .venv/bin/python benchmarks/bench_run_page.py                     # SQLite and PostgreSQL
    .venv/bin/python benchmarks/bench_run_page.py --backends sqlite --repeats 5
    .venv/bin/python benchmarks/bench_run_page.py --smoke             # tiny, for the tests

Each database is fresh (SQLite in a temp folder; PostgreSQL a new database on
CKVAL_TEST_POSTGRES_URL's server, dropped afterwards). One run gets --checkpoints
checkpoints through the registry as a reporter and a scheduler write them: each reports
--metrics metrics, and its validation (claimed and finished SUCCEEDED) returns the same
metrics again, so every checkpoint has them reported, validated and merged. Then the
run's data (/ui/api/runs/RUN) and page (/ui/runs/RUN) are requested through the real app
(FastAPI's TestClient: routing, registry reads, JSON; no network) with each --query,
--warmup times unmeasured and --repeats times measured; the median and 95th percentile of
the wall time, this process's CPU time and the answer's size are printed as a Markdown
table. The dashboard polls the run's data every 2 s while validations run.
"""

from __future__ import annotations

import argparse
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

RUN = "run-wide"
# What the run page asks by default, and for as many metrics as one request may.
QUERIES = ["", "max_metrics=500"]


def load(registry, checkpoints: int, metrics: int) -> float:
    """Registers the run's checkpoints and validates each; returns seconds."""
    from validation_service.registry.records import JobOutcome
    from validation_service.request import ValidationRequest

    started = time.perf_counter()
    request = ValidationRequest(
        executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
    )
    run_id = registry.ledger.ensure_run(RUN, storage_root="/nowhere")
    for index in range(checkpoints):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/nowhere/{RUN}/checkpoint_{index:06d}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics=_metrics(index, metrics, 0.0),
            step=index,
            job=request,
        )
    while claimed := registry.job_queue.claim_due_jobs(
        "bench", {"CPU": 64}, lease_s=600, max_jobs=64
    ):
        for job in claimed:
            outcome = JobOutcome(succeeded=True, metrics=_metrics(job.report_index, metrics, 0.5))
            assert registry.job_queue.finish_job(job.job_id, job.lease_token, outcome)
    return time.perf_counter() - started


def _metrics(index: int, count: int, offset: float) -> dict[str, float]:
    return {f"metric_{i:04d}": offset + (index * count + i) / 1e6 for i in range(count)}


def time_requests(registry, queries: list[str], warmup: int, repeats: int) -> list[dict]:
    from fastapi.testclient import TestClient

    from validation_service.api import create_app
    from validation_service.config import Settings

    app = create_app(Settings(service_name="ckval-bench-none"), registry)
    results = []
    with TestClient(app, base_url="http://localhost") as client:
        for what, path in [("run data", f"/ui/api/runs/{RUN}"), ("run page", f"/ui/runs/{RUN}")]:
            for query in queries:
                url = f"{path}?{query}" if query else path
                timed = time_get(client, url, warmup, repeats)
                results.append({"what": f"{what}{f' ?{query}' if query else ''}", **timed})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--checkpoints", type=int, default=200)
    parser.add_argument("--metrics", type=int, default=1000)
    parser.add_argument("--query", action="append", help=f"query strings (default {QUERIES})")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="10 checkpoints x 60, 2 repeats")
    args = parser.parse_args()
    if args.smoke:
        args.checkpoints, args.metrics, args.warmup, args.repeats = 10, 60, 0, 2
    os.environ.setdefault("CKVAL_HOME", tempfile.mkdtemp(prefix="bench-run-page-home-"))

    load_before = load_average()
    lines = [
        f"    {command_line()}",
        "",
        "| database | request | median ms | p95 ms | API CPU ms (median) | bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for backend, registry in fresh_registries(args.backends, "bench-run-page-"):
        seconds = load(registry, args.checkpoints, args.metrics)
        notes.append(
            f"- {backend}: {args.checkpoints} checkpoints x {args.metrics} metrics "
            f"(reported and validated) loaded in {seconds:.1f} s"
        )
        print(notes[-1], file=sys.stderr, flush=True)
        for row in time_requests(registry, args.query or QUERIES, args.warmup, args.repeats):
            lines.append(
                f"| {backend} | {row['what']} | {row['median']:.1f} | {row['p95']:.1f} "
                f"| {row['cpu']:.1f} | {row['bytes']:,} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", *notes, f"- load average before {load_before}, after {load_average()}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
