"""The scheduler alone: a real SQLite registry and a small real executor (a thread pool that
runs the same attempt body as the Ray task), no Ray and no service actor."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from validation_service.config import Settings, get_settings
from validation_service.executors import AttemptHandle
from validation_service.executors._run import run_attempt
from validation_service.payloads import signed_request
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.retry import RetryPolicy
from validation_service.service.scheduler import Scheduler
from validation_service.signing import PayloadTrust, job_binding
from validation_service.storage import CheckpointStorage

RUN = "sched"
RELEASE = threading.Event()  # what blocking validations wait for


def accuracy_of(checkpoint, config):
    """Reads the stored checkpoint: its accuracy file, times the config's scale."""
    with checkpoint.as_directory() as directory:
        value = json.loads((Path(directory) / "model.json").read_text())["accuracy"]
    return {"accuracy": value * config.get("scale", 1)}


def always_fails(checkpoint, config):
    raise OSError("the validation data is not reachable")


def returns_a_huge_accuracy(checkpoint, config):
    return {"accuracy": 1e300}


def takes_half_a_second(checkpoint, config):
    time.sleep(0.5)
    return {"accuracy": 0.5}


def fails_after_half_a_second(checkpoint, config):
    time.sleep(0.5)
    raise ConnectionError("the validation data went away")


def blocks(checkpoint, config):
    RELEASE.wait(30)
    return {"accuracy": 0.0}


@dataclasses.dataclass
class ThreadHandle(AttemptHandle):
    future: Future | None = None


class ThreadExecutor:
    """Runs attempts on threads of this process; remembers what it cancelled."""

    kind = "thread"

    def __init__(self):
        self.pool = ThreadPoolExecutor(4)
        self.cancelled: list[int] = []

    def launch(self, job: ClaimedJob) -> ThreadHandle:
        future = self.pool.submit(run_attempt, job, job.storage_root, {})
        return ThreadHandle(job, time.monotonic(), future)

    def poll(self, handle: ThreadHandle) -> JobOutcome | None:
        return JobOutcome(**handle.future.result()) if handle.future.done() else None

    def cancel(self, handle: ThreadHandle) -> None:
        self.cancelled.append(handle.job.job_id)

    def when_done(self, handle: ThreadHandle, callback: Callable[[], None]) -> None:
        handle.future.add_done_callback(lambda _future: callback())


@pytest.fixture
def registry(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    yield registry
    registry.close()


@pytest.fixture
def executor():
    RELEASE.clear()
    executor = ThreadExecutor()
    yield executor
    RELEASE.set()
    executor.pool.shutdown(wait=True)


def make_scheduler(registry, executor, **settings) -> Scheduler:
    values = dict(service_name="sched-test", heartbeat_s=0.001, poll_interval_s=0.01, lease_s=60)
    values.update(settings)
    return Scheduler(
        registry,
        Settings(**values),
        executors={executor.kind: executor},
        retry_policy=RetryPolicy(backoff_s=0.0),
    )


def report(registry, tmp_path, index, validate_fn, **request):
    storage = CheckpointStorage(str(tmp_path / "storage"))
    source = tmp_path / f"source-{index}"
    source.mkdir()
    (source / "model.json").write_text(json.dumps({"accuracy": index / 10}))
    stored = storage.upload(str(source), "default", RUN, index)
    run_id = registry.ledger.ensure_run(RUN, storage_root=str(tmp_path / "storage"))
    values = dict(
        executor_kind="thread",
        pool="CPU",
        validate_fn_name=validate_fn,
        validate_fn_ref=f"tests.test_scheduler:{validate_fn}",
        validate_config=None,
        max_attempts=2,
    )
    values.update(request)
    return registry.ledger.register_checkpoint(
        run_id,
        index,
        uri=stored.uri,
        size_bytes=stored.size_bytes,
        manifest_sha256=stored.manifest_sha256,
        reported_metrics={"loss": 1.0 - index / 10},
        job=signed(ValidationRequest(**values), index, stored.uri),
    ).job_id


def signed(request: ValidationRequest, index: int, uri: str) -> ValidationRequest:
    """The request signed as a reporter signs it (a reference is bound to its job too),
    with this process's key: the one run_attempt verifies with."""
    trust = PayloadTrust.from_settings(get_settings())
    return signed_request(request, trust, job_binding("default", RUN, index, uri))


def tick_until(scheduler, condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached within {timeout_s}s; stats {scheduler.stats}")
        scheduler.tick()
        time.sleep(0.01)


def statuses(registry):
    return [job.status for job in registry.validations(RUN)]


def test_runs_due_jobs_and_merges_their_metrics(registry, executor, tmp_path):
    for index in range(3):
        report(registry, tmp_path, index, "accuracy_of")
    scheduler = make_scheduler(registry, executor)
    thread = threading.Thread(target=scheduler.run_forever)
    thread.start()
    try:
        registry.wait(RUN, timeout_s=30)
    finally:
        scheduler.stop()
        thread.join(10)
    assert statuses(registry) == ["SUCCEEDED"] * 3
    assert [c.metrics["accuracy"] for c in registry.checkpoints(RUN)] == [0.0, 0.1, 0.2]
    [(_, best)] = registry.best_checkpoints(RUN, "accuracy")
    assert best["accuracy"] == 0.2
    assert scheduler.stats["claimed"] == scheduler.stats["finished"] == 3
    assert scheduler.in_flight == 0


def test_failures_follow_the_schedulers_retry_policy(registry, executor, tmp_path):
    job_id = report(registry, tmp_path, 0, "always_fails", max_attempts=2)
    scheduler = make_scheduler(registry, executor)
    tick_until(scheduler, lambda: statuses(registry) == ["FAILED"])
    job = registry.get_job(job_id)
    assert job.attempts == 2 and job.error_type == "OSError"
    assert [a.status for a in job.attempt_history] == ["FAILED", "FAILED"]
    assert "not reachable" in job.error_message


def test_pool_limit_caps_attempts_in_flight(registry, executor, tmp_path):
    for index in range(3):
        report(registry, tmp_path, index, "blocks")
    scheduler = make_scheduler(registry, executor, pools={"CPU": 1})
    for _ in range(3):
        scheduler.tick()
    assert scheduler.in_flight == 1
    assert sorted(statuses(registry)) == ["QUEUED", "QUEUED", "RUNNING"]
    RELEASE.set()
    tick_until(scheduler, lambda: statuses(registry) == ["SUCCEEDED"] * 3)


def test_an_attempt_past_its_timeout_is_cancelled_and_recorded(registry, executor, tmp_path):
    job_id = report(registry, tmp_path, 0, "blocks", timeout_s=0.2)
    scheduler = make_scheduler(registry, executor)
    tick_until(scheduler, lambda: statuses(registry) == ["TIMED_OUT"])
    assert executor.cancelled == [job_id]
    assert registry.get_job(job_id).error_type == "TimeoutError"
    assert scheduler.stats["timed_out"] == 1 and scheduler.in_flight == 0


@pytest.mark.parametrize("validate_fn", ["takes_half_a_second", "fails_after_half_a_second"])
def test_an_attempt_that_outlived_its_timeout_before_the_loop_looked_timed_out(
    registry, executor, tmp_path, validate_fn
):
    # A busy loop sees the attempt's start and its end together: it ran 0.5 s of its
    # 0.2, so it timed out, whatever it returned or raised.
    job_id = report(registry, tmp_path, 0, validate_fn, timeout_s=0.2)
    scheduler = make_scheduler(registry, executor)
    tick_until(scheduler, lambda: scheduler.in_flight == 1)
    [future] = [handle.future for _, handle in scheduler._in_flight.values()]
    future.result(timeout=10)
    scheduler.tick()
    job = registry.get_job(job_id)
    assert job.status == "TIMED_OUT" and job.error_type == "TimeoutError", job
    assert "timeout_s=0.2" in job.error_message
    assert job.attempts == 1 and executor.cancelled == []
    assert "accuracy" not in registry.checkpoints(RUN)[0].metrics
    assert scheduler.stats["timed_out"] == 1 and scheduler.in_flight == 0


def test_a_cancelled_job_stops_its_attempt_at_the_next_lease_check(registry, executor, tmp_path):
    job_id = report(registry, tmp_path, 0, "blocks")
    scheduler = make_scheduler(registry, executor, heartbeat_s=3600)
    tick_until(scheduler, lambda: scheduler.in_flight == 1)
    registry.cancel_jobs([job_id])
    scheduler.check_leases()
    scheduler.tick()
    assert executor.cancelled == [job_id] and scheduler.in_flight == 0
    assert statuses(registry) == ["CANCELLED"]


def test_a_job_of_an_unknown_kind_fails_without_retries(registry, executor, tmp_path):
    job_id = report(registry, tmp_path, 0, "accuracy_of", executor_kind="nowhere")
    scheduler = make_scheduler(registry, executor)
    scheduler.tick()
    job = registry.get_job(job_id)
    assert (job.status, job.error_type, job.attempts) == ("FAILED", "UnknownExecutor", 1)


def test_recover_requeues_what_an_earlier_incarnation_left_running(registry, executor, tmp_path):
    job_id = report(registry, tmp_path, 0, "accuracy_of")
    [claimed] = registry.job_queue.claim_due_jobs("sched-test/old-host:1", {}, lease_s=600)
    other = registry.job_queue.claim_due_jobs("other-service/x", {}, lease_s=600)
    assert claimed.job_id == job_id and other == []
    scheduler = make_scheduler(registry, executor)
    assert scheduler.recover() == [job_id]
    tick_until(scheduler, lambda: statuses(registry) == ["SUCCEEDED"])
    job = registry.get_job(job_id)
    assert [a.lease_owner for a in job.attempt_history] == [
        "sched-test/old-host:1",
        scheduler.owner,
    ]


def test_an_outcome_the_database_refuses_fails_the_job_once(
    postgres_server_url, executor, tmp_path
):
    registry = Registry(postgres_server_url, upgrade=True)
    try:
        with registry.engine.begin() as conn:
            conn.exec_driver_sql(
                "TRUNCATE runs, checkpoints, metric_values, validation_jobs, "
                "validation_attempts RESTART IDENTITY CASCADE"
            )
            # A rule of this database that ckval does not know: it refuses the outcome.
            conn.exec_driver_sql(
                "ALTER TABLE metric_values ADD CONSTRAINT test_sane CHECK (value < 1e200)"
            )
        job_id = report(registry, tmp_path, 0, "returns_a_huge_accuracy", max_attempts=3)
        scheduler = make_scheduler(registry, executor)
        tick_until(scheduler, lambda: statuses(registry) == ["FAILED"])
        job = registry.get_job(job_id)
        # Not retried: recording the same outcome again would be refused again.
        assert (job.error_type, job.attempts) == ("RegistryRejected", 1)
        assert "refused" in job.error_message
        assert scheduler.in_flight == 0 and scheduler.stats["finished"] == 1
    finally:
        with registry.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE metric_values DROP CONSTRAINT IF EXISTS test_sane")
        registry.close()


def test_the_cpu_pool_starts_as_many_attempts_as_it_has_warm_workers_growing_while_work_waits():
    """service/warmth.py: on a fresh cluster one process starts first; each second that
    due work waits for the limit, one more may start, up to the pool's size; a warm-up
    under way counts as a process starting."""
    from validation_service.service.warmth import GROW_AFTER_S, WarmWorkers

    warmth = WarmWorkers(pool_size=3)
    assert warmth.limit(busy=0, work_waits=True, now=0.0) == 1  # none known warm: one
    warmth.warming(1)
    assert warmth.limit(busy=0, work_waits=True, now=0.0) == 0  # that one is starting
    warmth.warming(0)
    warmth.saw([101, None])
    assert warmth.limit(busy=1, work_waits=True, now=0.1) == 1  # waits from now on
    assert warmth.limit(busy=1, work_waits=True, now=0.1 + GROW_AFTER_S / 2) == 1
    assert warmth.limit(busy=1, work_waits=True, now=0.1 + GROW_AFTER_S) == 2  # grew
    assert warmth.limit(busy=2, work_waits=True, now=0.1 + 1.5 * GROW_AFTER_S) == 2
    assert warmth.limit(busy=2, work_waits=True, now=0.1 + 2 * GROW_AFTER_S) == 3
    assert warmth.limit(busy=3, work_waits=True, now=0.1 + 9 * GROW_AFTER_S) == 3  # its size
    warmth.saw([101, 102, 103, 104])
    assert warmth.limit(busy=0, work_waits=False, now=20.0) == 3  # warm ones: at once
