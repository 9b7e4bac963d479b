"""Requests no node can serve, and validations waiting for resources, on the session's Ray
(a cluster of fixed nodes: Ray's monitor only mirrors them, no autoscaler can add one).
The same on an autoscaling cluster: tests/test_clusters.py."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
import uuid

import cloudpickle
import pytest
import ray
import ray.cloudpickle
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def read_value(checkpoint, config):
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "value.json")) as f:
            value = json.load(f)["value"]
    time.sleep(config.get("hold_s", 0))
    return {"score": value}


def checkpoint(tmp_path, value) -> Checkpoint:
    folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "value.json").write_text(json.dumps({"value": value}))
    return Checkpoint.from_directory(str(folder))


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def test_requests_no_node_offers_fail_by_name_while_the_runs_other_validations_go_on(
    service, tmp_path, unique_run
):
    asks = [
        {"num_cpus": 1},
        {"num_cpus": 1, "accelerator_type": "H100"},
        {"num_cpus": 1, "resources": {"tpu_v9": 1}},
        {"num_cpus": 64},  # the session's one node has 8
        {"num_cpus": 1},
    ]
    with Client(unique_run) as client:
        for value, resources in enumerate(asks):
            client.report(
                {"step": value},
                checkpoint(tmp_path, value),
                validate_fn=read_value,
                validation_resources=resources,
            )
    registry = Registry()
    registry.wait(unique_run, timeout_s=120, raise_on_failure=False)
    jobs = registry.validations(unique_run)
    assert [j.status for j in jobs] == ["SUCCEEDED", "FAILED", "FAILED", "FAILED", "SUCCEEDED"]
    h100, tpu, cpus = jobs[1], jobs[2], jobs[3]
    for job, named in [(h100, "'accelerator_type:H100'"), (tpu, "'tpu_v9'")]:
        assert job.error_type == "InfeasibleResources", job.error_message
        assert f"none offers {named}" in job.error_message, job.error_message
    assert "CPU 64 asked, at most 8 on one node" in cpus.error_message, cpus.error_message
    for job in (h100, tpu, cpus):
        # It lists what the cluster offers and says what to do; it failed at once, without
        # a retry, and held its pool's slot for no longer than its claim.
        assert "The cluster offers no accelerator type; node " in job.error_message
        assert f"ckval retry {job.id}" in job.error_message
        assert (job.attempts, job.max_attempts) == (1, 3)
        assert job.finished_at - job.created_at < dt.timedelta(seconds=60)
        [attempt] = job.attempt_history
        assert attempt.node_id is None and attempt.running_s is None  # never launched
    assert [c.validation_status for c in registry.checkpoints(unique_run)] == [
        "VALIDATED",
        "FAILED",
        "FAILED",
        "FAILED",
        "VALIDATED",
    ]
    registry.close()


@ray.remote(num_cpus=1)
class CpuHolder:
    def ping(self) -> bool:
        return True


def test_a_validation_waiting_for_cpus_is_shown_waiting_and_times_out_only_once_it_runs(
    service, tmp_path, unique_run
):
    holder = CpuHolder.remote()
    ray.get(holder.ping.remote())  # one of the node's 8 CPUs is held now
    timeout_s = 3.0
    try:
        with Client(unique_run) as client:
            client.report(
                {"step": 0},
                checkpoint(tmp_path, 7),
                validate_fn=read_value,
                validate_config={"hold_s": 0.5},
                validation_resources={"num_cpus": 8},
                timeout_s=timeout_s,
                max_attempts=1,
            )
        registry = Registry()

        def waiting():
            [job] = registry.validations(unique_run)
            return job if job.status == "WAITING_FOR_RESOURCES" else None

        job = wait_until(waiting, 60, "the job waiting for resources")
        assert job.waiting_for["resources"] == {"CPU": 8.0}
        assert "busy" in job.waiting_for["note"] and job.waiting_for["fits"]
        assert job.waiting_since is not None and job.lease_owner is not None
        [record] = registry.checkpoints(unique_run)
        assert record.validation_status == "PENDING"
        status = service.status()
        assert [w["job_id"] for w in status["waiting_for_resources"]] == [job.id]
        assert status["cluster"]["autoscaler"] is False  # the session's Ray has none
        # Its timeout would have passed by now if waiting counted.
        wait_until(
            lambda: (
                dt.datetime.now(dt.timezone.utc) - job.attempt_history[0].claimed_at
                > dt.timedelta(seconds=timeout_s + 1)
            ),
            30,
            "the wait outlasting timeout_s",
        )
        assert registry.validations(unique_run)[0].status == "WAITING_FOR_RESOURCES"
    finally:
        ray.kill(holder)
    registry.wait(unique_run, timeout_s=60)
    [job] = registry.validations(unique_run)
    assert job.status == "SUCCEEDED", (job.error_type, job.error_message)
    assert job.waiting_for is None and job.waiting_since is None
    [attempt] = job.attempt_history
    waited = (attempt.started_at - attempt.claimed_at).total_seconds()
    assert waited > timeout_s, waited
    assert 0.5 <= attempt.running_s < timeout_s
    assert (attempt.accelerators, attempt.accelerator_type, attempt.accelerator_s) == (0, None, 0)
    registry.close()
