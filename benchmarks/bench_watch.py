"""Watched folders: how long a complete step folder waits for its validation to start, and
what one listing of a folder of 10,000 step folders costs, locally and on S3.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_watch.py            # the figures
    PYTHONPATH=. .venv/bin/python benchmarks/bench_watch.py --smoke    # tiny, for CI

* latency: ``ray.init()`` on this machine's cores and the service on a fresh embedded
  registry, with the default listing interval (``CKVAL_WATCH_INTERVAL_S``, 5 s), then
  again with ``--short-interval``. A watch (``ready="auto"``) of an empty folder; one step
  folder at a time is written (its files, then DCP's ``.metadata``) at a random moment
  against the listings; the time from its ``.metadata`` written to its validation's
  attempt started on the worker (the attempt row's ``started_at``), ``--samples`` times.
  The validate_fn does nothing.
* listing: a folder of ``--folders`` complete step folders (local disk, then S3 on
  moto's server on loopback with ``--s3-folders``) and a watch of it, listed by a
  FolderWatcher in this process on a fresh SQLite registry. The first listing looks into
  each step folder (a ``find``) and registers every one with its job in one transaction;
  a steady listing (nothing new) is one listing of the folder and one read of the names
  registered: median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fresh_ckval_home, load_average, pickle_by_value, run_description  # noqa: E402


def noop_validate(checkpoint, config):
    return {"ok": 1.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20, help="step folders timed per interval")
    parser.add_argument("--short-interval", type=float, default=1.0)
    parser.add_argument("--folders", type=int, default=10_000)
    parser.add_argument("--s3-folders", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="2 samples, 50 folders")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.folders, args.s3_folders, args.repeats = 2, 50, 50, 2
    return args


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


# ------------------------------------------------------------------------- latency
def time_latency(interval_s: float | None, samples: int, workdir: Path) -> list[float]:
    """Seconds from each step folder's .metadata to its attempt's start, with the service
    listing every ``interval_s`` (None: the default)."""
    from validation_service import Registry, ValidationService

    overrides = {} if interval_s is None else {"watch_interval_s": interval_s}
    service = ValidationService.start(**overrides)
    registry = Registry()
    interval = registry.settings.watch_interval_s if interval_s is None else interval_s
    folder = workdir / f"steps-{interval}"
    folder.mkdir()
    run = f"latency-{interval:g}"
    watch_id = registry.watch(str(folder), run, noop_validate)
    waits = []
    try:
        for step in range(1, samples + 1):
            time.sleep(random.uniform(0, interval))  # a random phase against the listing
            waits.append(_one_step_folder(registry, run, folder, step))
    finally:
        registry.unwatch(watch_id)
        registry.close()
        service.stop()
    return waits


def _one_step_folder(registry, run: str, folder: Path, step: int) -> float:
    target = folder / f"step-{step}"
    target.mkdir()
    (target / "value.json").write_text(json.dumps({"step": step}))
    (target / ".metadata").write_text("{}")
    complete = dt.datetime.now(dt.timezone.utc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = registry.validations(run)
        if len(jobs) >= step:
            history = registry.get_job(jobs[step - 1].id).attempt_history
            if history and history[0].started_at is not None:
                return (history[0].started_at - complete).total_seconds()
        time.sleep(0.02)
    raise TimeoutError(f"step-{step}'s validation did not start")


# ------------------------------------------------------------------------- listing
def time_listing(uri: str, settings, repeats: int) -> dict[str, float]:
    """The first listing (registering every step folder) and steady listings, in seconds."""
    from validation_service.registry.registry import Registry
    from validation_service.service.watcher import FolderWatcher

    registry = Registry(settings=settings)
    try:
        registry.watch(uri, "listed", noop_validate)
        watcher = FolderWatcher(registry.watch_listings, settings, "bench/1")
        started = time.perf_counter()
        registered = watcher.tick()
        first = time.perf_counter() - started
        steady = []
        for _ in range(repeats):
            started = time.perf_counter()
            assert watcher.tick() == 0
            steady.append(time.perf_counter() - started)
    finally:
        registry.close()
    return {"registered": registered, "first": first, "steady": statistics.median(steady)}


def listing_settings(workdir: Path, tag: str, **extra):
    from validation_service.config import Settings

    return Settings(
        home=workdir / f"home-{tag}",
        database_url=f"sqlite:///{workdir / f'listing-{tag}.db'}",
        storage=str(workdir / f"store-{tag}"),
        watch_interval_s=0.001,
        **extra,
    )


def local_listing(count: int, repeats: int, workdir: Path) -> dict[str, float]:
    folder = workdir / "local-steps"
    for step in range(count):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / ".metadata").write_text("{}")
    return time_listing(str(folder), listing_settings(workdir, "local"), repeats)


def s3_listing(count: int, repeats: int, workdir: Path) -> dict[str, float]:
    import boto3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.moto_s3 import CREDENTIALS, moto_s3_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request lines
    with moto_s3_server("trainer") as endpoint:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        for step in range(count):
            client.put_object(Bucket="trainer", Key=f"run/step-{step}/.metadata", Body=b"{}")
        options = {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
        }
        settings = listing_settings(workdir, "s3", storage_options=options)
        return time_listing("s3://trainer/run", settings, repeats)


# ------------------------------------------------------------------------- report
def main() -> None:
    args = parse_args()
    load_before = load_average()
    workdir = fresh_ckval_home("ckval-bench-watch-")
    pickle_by_value(__name__)
    import ray

    from validation_service.secrets import ckval_env

    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ckval_env()})
    default = time_latency(None, args.samples, workdir)
    short = time_latency(args.short_interval, args.samples, workdir)
    ray.shutdown()
    local = local_listing(args.folders, args.repeats, workdir)
    s3 = s3_listing(args.s3_folders, args.repeats, workdir)
    for key, value in run_description(load_before).items():
        print(f"{key}: {value}")
    print()
    print("| folder complete -> validation started | samples | median (s) | p90 (s) |")
    print("|---|---:|---:|---:|")
    for label, waits in (
        (f"default interval ({5:g} s)", default),
        (f"--short-interval {args.short_interval:g} s", short),
    ):
        print(
            f"| {label} | {len(waits)} | {statistics.median(waits):.2f} "
            f"| {percentile(waits, 0.9):.2f} |"
        )
    print("\n| listing a watched folder | step folders | first listing, registers all (s) "
          "| steady listing, median (s) |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for label, found, count in (
        ("local disk", local, args.folders),
        ("S3 (moto)", s3, args.s3_folders),
    ):  # noqa: E501
        assert found["registered"] == count, found
        print(f"| {label} | {count} | {found['first']:.2f} | {found['steady']:.3f} |")


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tempfile.tempdir = None
    main()
