"""Service replicas on a real Ray and PostgreSQL: the first starts the others, status and
/metrics list them, and a replica killed with validations in flight loses nothing."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections import Counter

import cloudpickle
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.train import Checkpoint

from trainer_integration import Client
from validation_service.config import Settings
from validation_service.errors import InvalidSettings
from validation_service.registry.registry import Registry
from validation_service.service import ValidationService

pytestmark = pytest.mark.ray
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not happen within {timeout_s}s")


def hold(checkpoint, config):
    time.sleep(config["hold_s"])
    with open(config["log"], "a") as log:
        log.write(f"{config['index']}\n")
    return {"index": float(config["index"])}


@pytest.fixture
def two_replicas(ray_session, postgres_server_url, monkeypatch):
    registry = Registry(postgres_server_url, upgrade=True)
    name = f"ckval-ha-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("CKVAL_DATABASE_URL", postgres_server_url)
    monkeypatch.setenv("CKVAL_SERVICE_NAME", name)
    handle = ValidationService.start(replicas=2, pools={"CPU": 4}, heartbeat_s=1.0, lease_s=6.0)
    yield handle, registry
    handle.stop()
    registry.close()


def both_alive(handle):
    replicas = handle.status()["replicas"]
    return replicas if all(replica["alive"] for replica in replicas) else None


def test_two_replicas_share_the_queue_and_survive_a_kill_9(two_replicas, tmp_path):
    handle, registry = two_replicas
    replicas = wait_for(lambda: both_alive(handle), 120, "both replicas answering")
    assert [r["name"] for r in replicas] == [
        handle.settings.service_name,
        f"{handle.settings.service_name}-replica-1",
    ]
    assert all(r["pid"] and r["node_id"] for r in replicas)

    run = f"ha-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "executions.log"
    client = Client(run)
    count = 16
    for index in range(count):
        (tmp_path / f"c{index}").mkdir()
        client.report(
            {"step": index},
            Checkpoint.from_directory(str(tmp_path / f"c{index}")),
            validate_fn=hold,
            validate_config={"hold_s": 1.0, "log": str(log), "index": index},
        )
    # A replica holding leases is killed (the second, when both hold some). Which one
    # claims first is a race: a replica whose validation ends claims again at once, and
    # the other claims at a report's wake-up or its next poll.
    owners = wait_for(lambda: _running_owners(registry, run), 60, "a replica claiming")
    assert sum(owners.values()) <= 4  # the pool's cap (4) is the cluster's
    by_name = {r["name"]: i for i, r in enumerate(replicas)}
    victim_index = max(by_name[name] for name in owners)
    victim = replicas[victim_index]
    os.kill(victim["pid"], signal.SIGKILL)
    registry.wait(run, timeout_s=240)

    jobs = registry.validations(run)
    assert Counter(job.status for job in jobs) == {"SUCCEEDED": count}
    for job in jobs:
        assert sum(a.status == "SUCCEEDED" for a in job.attempt_history) == 1
    assert set(int(line) for line in log.read_text().split()) == set(range(count))
    # Ray restarts the killed replica's process; it rejoins under the same name.
    again = wait_for(lambda: both_alive(handle), 120, "the killed replica back")
    assert again[victim_index]["pid"] != victim["pid"]


def _running_owners(registry: Registry, run: str) -> Counter:
    """The replicas holding the run's RUNNING jobs now, with how many each holds."""
    return Counter(
        job.lease_owner.split("/")[0]
        for job in registry.validations(run)
        if job.status == "RUNNING" and job.lease_owner
    )


def test_metrics_have_a_series_per_replica(two_replicas):
    from fastapi.testclient import TestClient

    from validation_service.api import create_app

    handle, registry = two_replicas
    wait_for(lambda: both_alive(handle), 120, "both replicas answering")
    wait_for(lambda: len(registry.replicas.list(handle.settings.service_name)) == 2, 30, "rows")
    app = create_app(registry=registry, settings=handle.settings)
    text = TestClient(app, base_url="http://localhost").get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    up = {s.labels["replica"]: s.value for s in families["ckval_replica_up"].samples}
    assert up == {handle.settings.service_name: 1, f"{handle.settings.service_name}-replica-1": 1}
    assert "ckval_replica_leases" in families
    assert "ckval_replica_heartbeat_age_seconds" in families


def test_more_than_one_replica_on_sqlite_is_refused_before_anything_starts(ray_session, tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}", service_name="no-ha")
    with pytest.raises(InvalidSettings, match="CKVAL_REPLICAS=2 needs a PostgreSQL registry"):
        ValidationService.start(settings=settings, replicas=2)
    with pytest.raises(ValueError):
        ray.get_actor("no-ha", namespace=settings.ray_namespace)
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("count", ["0", "17", "two"])
def test_a_bad_replica_count_names_the_variable(count, monkeypatch):
    monkeypatch.setenv("CKVAL_REPLICAS", count)
    with pytest.raises(InvalidSettings, match="CKVAL_REPLICAS"):
        Settings()
