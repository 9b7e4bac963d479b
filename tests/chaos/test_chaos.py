"""Chaos: crashes, hangs and lost connections; every acknowledged report is validated once.

Each test prints its figure (what was injected, what survived) and asserts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import cloudpickle
import pytest
import sqlalchemy as sa
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.jobs import ACTIVE_JOB_STATUSES
from validation_service.registry.registry import Registry
from validation_service.service import ValidationService

pytestmark = pytest.mark.ray
cloudpickle.register_pickle_by_value(sys.modules[__name__])
REPORTER = Path(__file__).with_name("reporter_process.py")


def figure(text: str) -> None:
    print(f"\nCHAOS FIGURE: {text}")


def checkpoint_with(tmp_path: Path, name: str, content: str = "x") -> Checkpoint:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "step.txt").write_text(content)
    return Checkpoint.from_directory(str(directory))


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen within {timeout_s}s")


def assert_validated_exactly_once(registry: Registry, run: str, expected: int) -> None:
    jobs = registry.validations(run)
    assert len(registry.checkpoints(run)) == expected
    assert len(jobs) == expected
    assert Counter(job.status for job in jobs) == {"SUCCEEDED": expected}
    for job in jobs:
        merged = [a for a in job.attempt_history if a.status == "SUCCEEDED"]
        assert len(merged) == 1, (job.id, job.attempt_history)
    assert all(c.validated_metrics for c in registry.checkpoints(run))


def reporter_env(**extra: str) -> dict[str, str]:
    import ray

    env = dict(os.environ)
    env.update(
        CKVAL_RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1", **extra
    )
    return env


def hold_then_log(checkpoint, config):
    time.sleep(config["hold_s"])
    with open(config["log"], "a") as f:
        f.write(f"{config['index']}\n")
    return {"ok": 1.0, "index": config["index"]}


def test_kill_9_of_the_service_loses_and_duplicates_nothing(service, tmp_path, unique_run):
    count = 24
    log = tmp_path / "executions.log"
    client = Client(unique_run)
    for index in range(count):
        client.report(
            {"step": index},
            checkpoint_with(tmp_path, f"c{index}"),
            validate_fn=hold_then_log,
            validate_config={"hold_s": 1.0, "log": str(log), "index": index},
        )
    registry = Registry()
    wait_for(
        lambda: registry.job_counts(unique_run).get("RUNNING", 0) >= 3, 60, "validations running"
    )
    before = service.status()
    in_flight = sum(registry.job_counts(unique_run).get(s.value, 0) for s in ACTIVE_JOB_STATUSES)
    os.kill(before["pid"], signal.SIGKILL)
    registry.wait(unique_run, timeout_s=240)
    after = service.status()
    assert after["pid"] != before["pid"] and after["recovered"] >= 1
    assert_validated_exactly_once(registry, unique_run, count)
    executions = Counter(int(line) for line in log.read_text().split())
    assert set(executions) == set(range(count))
    figure(
        f"kill -9 of the service with {in_flight} validations in flight: "
        f"{count}/{count} validated after restart, 0 duplicates merged, 0 lost; "
        f"{after['recovered']} requeued at restart, "
        f"{sum(executions.values()) - count} re-executed"
    )


def exit_on_first_attempt(checkpoint, config):
    marker = Path(config["marker"])
    if not marker.exists():
        marker.write_text("crashed once")
        os._exit(1)  # the worker process dies without a word
    return {"recovered": 1.0}


def always_exit(checkpoint, config):
    os._exit(3)


def test_validate_fn_that_hard_exits_is_retried(service, tmp_path, unique_run):
    client = Client(unique_run)
    client.report(
        {"a": 1},
        checkpoint_with(tmp_path, "a"),
        validate_fn=exit_on_first_attempt,
        validate_config={"marker": str(tmp_path / "marker")},
        max_attempts=3,
    )
    client.report({"a": 2}, checkpoint_with(tmp_path, "b"), validate_fn=always_exit, max_attempts=2)
    client.wait(timeout_s=120)
    first, second = Registry().validations(unique_run)
    assert (first.status, first.attempts) == ("SUCCEEDED", 2)
    assert first.attempt_history[0].status == "FAILED"
    assert (second.status, second.attempts) == ("FAILED", 2)
    assert "Worker" in second.error_type or "worker" in (second.error_message or "").lower()
    figure(
        f"os._exit in validate_fn: retried, then succeeded on attempt 2; "
        f"always-exiting one FAILED after 2 attempts ({second.error_type})"
    )


def hang(checkpoint, config):
    Path(config["pid_file"]).write_text(str(os.getpid()))
    time.sleep(3600)
    return {}


def test_hanging_validate_fn_times_out_and_its_task_is_gone(service, tmp_path, unique_run):
    pid_file = tmp_path / "pid"
    timeout_s = 3.0
    client = Client(unique_run)
    client.report(
        {"a": 1},
        checkpoint_with(tmp_path, "a"),
        validate_fn=hang,
        validate_config={"pid_file": str(pid_file)},
        timeout_s=timeout_s,
    )
    client.wait(timeout_s=120)
    [job] = Registry().validations(unique_run)
    assert job.status == "TIMED_OUT" and "timeout_s=3" in job.error_message
    took = (job.finished_at - job.attempt_history[0].claimed_at).total_seconds()
    assert timeout_s <= took < timeout_s + 5
    pid = int(pid_file.read_text())

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, 30, f"worker process {pid} of the cancelled task to exit")
    figure(
        f"hanging validate_fn with timeout_s={timeout_s:g}: TIMED_OUT after {took:.1f}s, "
        "its worker process is gone"
    )


def test_killed_training_driver_still_gets_every_checkpoint_validated(
    service, tmp_path, unique_run
):
    count = 6
    log = tmp_path / "executions.log"
    done = subprocess.run(
        [
            sys.executable,
            str(REPORTER),
            unique_run,
            str(count),
            "--hold-s",
            "1",
            "--log",
            str(log),
            "--die",
        ],
        env=reporter_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert done.stdout.count("acknowledged") == count
    registry = Registry()
    registry.wait(unique_run, timeout_s=180)
    assert_validated_exactly_once(registry, unique_run, count)
    figure(
        f"training driver killed with SIGKILL after {count} acknowledged reports: "
        f"{count}/{count} validated"
    )


def run_reporters(runs: list[str], count: int, env: dict[str, str]) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, str(REPORTER), run, str(count)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in runs
    ]
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]


# Each of the eight reporters' reports (benchmarks/bench_registry.py measures the rate).
REPORTS_PER_REPORTER = 50


def concurrent_reporters(registry: Registry, env: dict[str, str], prefix: str) -> str:
    runs = [f"{prefix}-{i}" for i in range(8)]
    started = time.perf_counter()
    run_reporters(runs, REPORTS_PER_REPORTER, env)
    reported = time.perf_counter() - started
    for run in runs:
        registry.wait(run, timeout_s=600)
    for run in runs:
        assert_validated_exactly_once(registry, run, REPORTS_PER_REPORTER)
    total = 8 * REPORTS_PER_REPORTER
    return (
        f"8 processes x {REPORTS_PER_REPORTER} reports: {total} registered, {total} validated, "
        f"none twice ({total / reported:.0f} reports/s acknowledged, all validated "
        f"{time.perf_counter() - started:.0f}s after start)"
    )


def test_eight_concurrent_reporters_on_sqlite(service, unique_run):
    figure("SQLite: " + concurrent_reporters(Registry(), reporter_env(), unique_run))


@pytest.fixture(scope="module")
def postgres_service(ray_session, postgres_server_url):
    registry = Registry(postgres_server_url, upgrade=True)
    name = f"ckval-pg-{os.getpid()}"
    handle = ValidationService.start(database_url=postgres_server_url, service_name=name)
    yield registry, name, postgres_server_url
    handle.stop()
    registry.close()


def test_eight_concurrent_reporters_on_postgres(postgres_service, unique_run):
    registry, name, url = postgres_service
    env = reporter_env(CKVAL_DATABASE_URL=url, CKVAL_SERVICE_NAME=name)
    figure("PostgreSQL: " + concurrent_reporters(registry, env, unique_run))


def test_postgres_connections_killed_mid_run(postgres_service, tmp_path, unique_run):
    registry, name, url = postgres_service
    env = reporter_env(CKVAL_DATABASE_URL=url, CKVAL_SERVICE_NAME=name)
    count = 60
    process = subprocess.Popen(
        [sys.executable, str(REPORTER), unique_run, str(count), "--hold-s", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    database = sa.engine.make_url(url).database
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    killed = 0
    for _ in range(3):
        time.sleep(2)
        with admin.connect() as conn:
            killed += conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": database},
            ).scalar_one()
    out, err = process.communicate(timeout=600)
    admin.dispose()
    assert process.returncode == 0, err[-3000:]
    assert out.count("acknowledged") == count
    registry.wait(unique_run, timeout_s=300)
    assert_validated_exactly_once(registry, unique_run, count)
    figure(
        f"PostgreSQL backends terminated 3 times ({killed} connections) during "
        f"{count} reports: {count}/{count} validated, nothing lost"
    )
