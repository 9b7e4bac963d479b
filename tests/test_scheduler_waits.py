"""The scheduler with attempts that wait for resources: a real SQLite registry and a small
real executor whose attempts start only when their resources come (a gate), with the
cluster's offer given as a capacity.ClusterOffer. No Ray: tests/test_resource_waits.py
and tests/test_clusters.py run the same on Ray, with and without an autoscaler."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import threading
import time

import pytest
import ray.train  # noqa: F401 - an attempt imports it: here, not inside a timed attempt

from tests.test_scheduler import (
    RELEASE,
    RUN,
    ThreadExecutor,
    ThreadHandle,
    make_scheduler,
    report,
    statuses,
    tick_until,
)
from validation_service.capacity import ClusterOffer, Offer, demand_of
from validation_service.executors import AttemptUsage
from validation_service.executors._run import run_attempt
from validation_service.registry.records import ClaimedJob
from validation_service.registry.registry import Registry
from validation_service.service import resource_waits

A10G_NODE_TYPE = Offer("node type", "a10g", {"CPU": 2, "GPU": 1, "accelerator_type:A10G": 1}, 2)
A10G = {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A10G"}


@dataclasses.dataclass
class GatedHandle(ThreadHandle):
    running_since: float | None = None
    usage: AttemptUsage | None = None


class GatedExecutor(ThreadExecutor):
    """Attempts wait at a gate (their resources) before they run; the cluster offers
    what ``offer`` says."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.offer = ClusterOffer(
            nodes=(Offer("node", "head", {"CPU": 1}),),
            node_types=(A10G_NODE_TYPE,),
            node_types_from="a test's node types",
            autoscaler=True,
        )
        self.launched: list[int] = []

    def launch(self, job: ClaimedJob) -> GatedHandle:
        self.launched.append(job.job_id)
        handle = GatedHandle(job, time.monotonic())
        handle.future = self.pool.submit(self._run, handle)
        return handle

    def _run(self, handle: GatedHandle) -> dict:
        while not self.gate.wait(0.05):
            if handle.job.job_id in self.cancelled:
                return {"succeeded": False, "error_type": "TaskCancelled", "retryable": False}
        started_at = dt.datetime.now(dt.timezone.utc)
        handle.usage = AttemptUsage("node-a10g-1", started_at, "A10G", 1.0)
        handle.running_since = time.monotonic()
        return run_attempt(handle.job, handle.job.storage_root, {})

    def poll(self, handle: GatedHandle):
        """As the Ray task executor's: the outcome with what the attempt held where."""
        outcome = super().poll(handle)
        if outcome is None or handle.usage is None:
            return outcome
        held = handle.usage.outcome_fields()
        return dataclasses.replace(outcome, node_id=handle.usage.node_id, **held)

    def started(self, handle: GatedHandle) -> float | None:
        return handle.running_since

    def usage(self, handle: GatedHandle) -> AttemptUsage | None:
        return handle.usage

    def judge(self, job: ClaimedJob):
        return self.offer.judge(demand_of(job.resources))


@pytest.fixture
def registry(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    yield registry
    registry.close()


@pytest.fixture
def executor(monkeypatch):
    monkeypatch.setattr(resource_waits, "WAITING_AFTER_S", 0.05)
    RELEASE.clear()
    executor = GatedExecutor()
    yield executor
    executor.gate.set()
    RELEASE.set()
    executor.pool.shutdown(wait=True)


def gated_scheduler(registry, executor, **settings):
    return make_scheduler(registry, executor, **settings)


def test_an_attempt_waiting_for_a_node_shows_it_and_its_timeout_counts_once_it_runs(
    registry, executor, tmp_path
):
    job_id = report(
        registry, tmp_path, 0, "accuracy_of", resources=A10G, pool="A10G", timeout_s=0.5
    )
    scheduler = gated_scheduler(registry, executor)
    tick_until(scheduler, lambda: statuses(registry) == ["WAITING_FOR_RESOURCES"])
    job = registry.get_job(job_id)
    assert job.waiting_for == {
        "resources": {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001},
        "fits": ["node type a10g"],
        "note": "the autoscaler can add a node of type a10g",
    }
    assert job.lease_owner == scheduler.owner and job.waiting_since is not None
    assert registry.checkpoints(RUN)[0].validation_status == "PENDING"
    [waiting] = scheduler.waiting_for_resources()
    assert (waiting["job_id"], waiting["pool"]) == (job_id, "A10G")
    # Longer than its timeout_s: still waiting, not TIMED_OUT.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        scheduler.tick()
        time.sleep(0.02)
    assert statuses(registry) == ["WAITING_FOR_RESOURCES"]
    executor.gate.set()
    tick_until(scheduler, lambda: statuses(registry) == ["SUCCEEDED"])
    job = registry.get_job(job_id)
    assert (job.waiting_for, job.waiting_since) == (None, None)
    [attempt] = job.attempt_history
    assert (attempt.node_id, attempt.accelerator_type, attempt.accelerators) == (
        "node-a10g-1",
        "A10G",
        1.0,
    )
    assert attempt.running_s is not None and attempt.accelerator_s == attempt.running_s
    assert (attempt.started_at - attempt.claimed_at).total_seconds() > 0.5


def test_a_timeout_counts_from_the_start_and_the_running_time_is_recorded(
    registry, executor, tmp_path
):
    job_id = report(registry, tmp_path, 0, "blocks", resources=A10G, pool="A10G", timeout_s=0.3)
    executor.gate.set()
    scheduler = gated_scheduler(registry, executor)
    tick_until(scheduler, lambda: statuses(registry) == ["TIMED_OUT"])
    [attempt] = registry.get_job(job_id).attempt_history
    assert executor.cancelled == [job_id]
    assert attempt.accelerator_type == "A10G" and attempt.running_s >= 0.3


def test_a_wait_longer_than_resource_wait_s_fails_the_job_and_stops_its_task(
    registry, executor, tmp_path
):
    job_id = report(registry, tmp_path, 0, "accuracy_of", resources=A10G, pool="A10G", timeout_s=60)
    scheduler = gated_scheduler(registry, executor, resource_wait_s=0.4)
    tick_until(scheduler, lambda: statuses(registry) == ["FAILED"])
    job = registry.get_job(job_id)
    assert job.error_type == "ResourcesUnavailable" and job.attempts == 1
    assert re.match(r"waited [\d.]+s for a node to run its task", job.error_message)
    said = ("{CPU 1, GPU 1, accelerator_type:A10G}", "a node of type a10g")
    for words in (*said, "CKVAL_RESOURCE_WAIT_S=0.4", f"ckval retry {job_id}"):
        assert words in job.error_message, job.error_message
    assert executor.cancelled == [job_id] and scheduler.in_flight == 0
    assert scheduler.stats["waited_too_long"] == 1
    assert job.attempt_history[0].running_s is None  # it never ran: nothing held


def test_a_request_no_node_type_offers_fails_before_launch_without_holding_its_slot(
    registry, executor, tmp_path
):
    typo = {"num_cpus": 1, "num_gpus": 1, "resources": {"A10g_slot": 1}}
    bad = report(registry, tmp_path, 0, "accuracy_of", resources=typo, pool="GPU")
    good = report(registry, tmp_path, 1, "accuracy_of", resources=A10G, pool="GPU")
    executor.gate.set()
    scheduler = gated_scheduler(registry, executor, pools={"GPU": 1})
    scheduler.tick()
    assert statuses(registry) == ["FAILED", "QUEUED"]  # the slot is free at once
    tick_until(scheduler, lambda: statuses(registry) == ["FAILED", "SUCCEEDED"])
    assert executor.launched == [good]  # the refused job's task never started
    job = registry.get_job(bad)
    assert job.error_type == "InfeasibleResources" and job.attempts == 1
    assert "none offers 'A10g_slot'" in job.error_message
    assert "node type a10g, up to 2: CPU 2, GPU 1, accelerator_type:A10G" in job.error_message
    assert scheduler.stats["infeasible"] == 1


def test_a_waiting_attempt_is_judged_again_and_fails_when_its_node_type_is_gone(
    registry, executor, tmp_path, monkeypatch
):
    monkeypatch.setattr(resource_waits, "REJUDGE_S", 0.1)
    job_id = report(registry, tmp_path, 0, "accuracy_of", resources=A10G, pool="A10G")
    scheduler = gated_scheduler(registry, executor)
    tick_until(scheduler, lambda: statuses(registry) == ["WAITING_FOR_RESOURCES"])
    executor.offer = dataclasses.replace(executor.offer, node_types=())
    tick_until(scheduler, lambda: statuses(registry) == ["FAILED"])
    job = registry.get_job(job_id)
    assert job.error_type == "InfeasibleResources", job.error_message
    assert "none offers 'GPU'" in job.error_message and executor.cancelled == [job_id]


def test_an_attempt_stopped_after_its_lease_was_lost_records_what_it_held(
    registry, executor, tmp_path
):
    job_id = report(registry, tmp_path, 0, "blocks", resources=A10G, pool="A10G")
    executor.gate.set()
    scheduler = gated_scheduler(registry, executor, heartbeat_s=3600)
    tick_until(
        scheduler,
        lambda: (
            scheduler.in_flight == 1 and executor.usage(scheduler._in_flight[job_id][1]) is not None
        ),
    )
    registry.cancel_jobs([job_id])
    scheduler.check_leases()
    scheduler.tick()
    [attempt] = registry.get_job(job_id).attempt_history
    assert attempt.status == "CANCELLED" and executor.cancelled == [job_id]
    assert (attempt.accelerator_type, attempt.accelerators) == ("A10G", 1.0)
    assert attempt.running_s is not None and attempt.node_id == "node-a10g-1"
