"""What validations held and which jobs wait for resources, as every surface shows it: the
registry (on SQLite and PostgreSQL), the CLI's fast read and Registry path, the HTTP API,
the run page's JSON and /metrics. No Ray: the attempts' outcomes are recorded as the
scheduler records them."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from validation_service.api import create_app
from validation_service.cli import main
from validation_service.config import Settings
from validation_service.registry import _fast_read
from validation_service.registry.records import JobOutcome
from validation_service.request import ValidationRequest
from validation_service.retry import RetryPolicy

RUN = "cost-run"
OWNER = "costs-test/1"
A10G = {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A10G"}
T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
SETTINGS = Settings(service_name="ckval-costs-test-none")


def held(seconds: float, accelerators: float = 1.0, **outcome) -> JobOutcome:
    """An attempt's outcome as the scheduler records it: it ran ``seconds`` on an A10G node."""
    values = dict(
        succeeded=True,
        metrics={"accuracy": 0.5},
        node_id="a10g-node-1",
        started_at=T0,
        finished_at=T0 + dt.timedelta(seconds=seconds),
        accelerator_type="A10G",
        accelerators=accelerators,
    )
    values.update(outcome)
    return JobOutcome(**values)


@pytest.fixture
def spent(registry):
    """A run whose validations held 130 A10G-seconds: report 0 60 s, report 1 30 s on a
    failed attempt and 20 s on its retry, a named evaluation of report 0 on 2 GPUs for
    10 s; report 2 WAITING_FOR_RESOURCES."""
    run_id = registry.ledger.ensure_run(RUN, storage_root="/ckpts")
    for index in range(3):
        registry.ledger.register_checkpoint(
            run_id,
            index,
            uri=f"/ckpts/{index}",
            size_bytes=1,
            manifest_sha256=None,
            reported_metrics={"loss": 1.0},
            job=ValidationRequest(
                executor_kind="ray_task",
                pool="A10G",
                validate_fn_name="f",
                validate_fn_ref="json:dumps",
                resources=A10G,
            ),
        )
    queue = registry.job_queue
    policy = RetryPolicy(backoff_s=0.0)
    first, second, third = queue.claim_due_jobs(OWNER, {"A10G": 4}, lease_s=600)
    assert queue.finish_job(first.job_id, first.lease_token, held(60), policy=policy)
    lost = held(30, succeeded=False, metrics=None, error_type="OSError", retryable=True)
    assert queue.finish_job(second.job_id, second.lease_token, lost, policy=policy)
    waits_for = {"resources": {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}}
    waits_for.update(fits=["node type a10g"], note="the autoscaler can add a node of type a10g")
    assert queue.wait_for_resources(OWNER, [(third.job_id, third.lease_token, waits_for)])
    [again] = queue.claim_due_jobs(OWNER, {"A10G": 4}, lease_s=600)
    assert queue.finish_job(again.job_id, again.lease_token, held(20), policy=policy)
    [named] = registry.revalidate(
        RUN, "json:dumps", validator="v2", reports=[0], validation_resources=dict(A10G, num_gpus=2)
    )
    [claimed] = queue.claim_due_jobs(OWNER, {"A10G": 4}, lease_s=600)
    assert claimed.job_id == named
    assert queue.finish_job(named, claimed.lease_token, held(10, accelerators=2), policy=policy)
    return {"waiting": third.job_id, "retried": second.job_id}


def test_each_attempt_records_what_it_held_and_the_run_sums_it(registry, spent):
    retried = registry.get_job(spent["retried"])
    assert [(a.status, a.running_s, a.accelerator_s) for a in retried.attempt_history] == [
        ("FAILED", 30.0, 30.0),
        ("SUCCEEDED", 20.0, 20.0),
    ]
    assert {a.accelerator_type for a in retried.attempt_history} == {"A10G"}
    [summary] = registry.run_summaries()
    assert summary.cost.accelerator_s == 130.0 and summary.cost.running_s == 120.0
    assert summary.cost.by("validator") == {"default": 110.0, "v2": 20.0}
    assert summary.cost.by("pool") == {"A10G": 130.0}
    assert summary.cost.by("accelerator_type") == {"A10G": 130.0}
    costs = registry.validation_costs(RUN)
    assert {index: cost.accelerator_s for index, cost in costs.items()} == {0: 80.0, 1: 50.0}
    assert costs[0].by("validator") == {"default": 60.0, "v2": 20.0}


def test_the_clis_fast_read_sums_the_same(registry, spent, monkeypatch):
    if registry.engine.dialect.name != "sqlite":
        pytest.skip("the fast read is the embedded SQLite registry's")
    monkeypatch.delenv("CKVAL_KEEP_WARM")  # a checked setting sends the CLI to the Registry
    path = registry.engine.url.database
    reader = _fast_read.open_reader(f"sqlite:///{path}", "default")
    assert reader is not None
    with reader:
        assert reader.run_summaries() == registry.run_summaries()
        assert reader.validation_costs(RUN) == registry.validation_costs(RUN)
        assert reader.list_jobs(RUN) == registry.list_jobs(RUN)


def cli(registry, *args) -> str:
    """The command's output: on SQLite through the fast read (no checked CKVAL_*
    setting), on PostgreSQL through the Registry."""
    url = registry.engine.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(main, ["--database-url", url, *args], env={"CKVAL_KEEP_WARM": None})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_cli_shows_accelerator_seconds_per_run_checkpoint_validator_and_pool(registry, spent):
    runs = cli(registry, "runs")
    assert "accelerator-s (by pool)" in runs and "130 (A10G 130)" in runs
    assert "WAITING_FOR_RESOURCES=1" in runs
    checkpoints = cli(registry, "checkpoints", RUN)
    assert "accelerator-s" in checkpoints
    assert "80 (default 60, v2 20)" in checkpoints and "50 (default 50)" in checkpoints
    assert "validation cost of cost-run: 130 accelerator-seconds (0.03611 h), 120 s running" in (
        checkpoints
    )
    assert "  by validator: default 110, v2 20\n  by pool: A10G 130\n  by type: A10G 130" in (
        checkpoints
    )
    runs_json = cli(registry, "runs", "--json")
    assert '"accelerator_seconds": 130.0' in runs_json


def test_the_cli_shows_a_job_waiting_for_resources_and_what_it_waits_for(registry, spent):
    jobs = cli(registry, "jobs", RUN, "--status", "waiting_for_resources")
    [row] = [line for line in jobs.splitlines() if "WAITING_FOR_RESOURCES" in line]
    assert re.search(
        r"waiting \d+s for \{CPU: 1, GPU: 1, accelerator_type:A10G\}: the autoscaler can add "
        "a node of type a10g",
        row,
    ), row
    job = cli(registry, "job", str(spent["waiting"]))
    assert "WAITING_FOR_RESOURCES" in job
    assert "for {CPU: 1, GPU: 1, accelerator_type:A10G}" in job
    retried = cli(registry, "job", str(spent["retried"]))
    assert "1 x A10G, 30 accelerator-s" in retried and "1 x A10G, 20 accelerator-s" in retried


def test_the_api_and_the_run_page_show_the_cost_and_the_wait(registry, spent):
    with TestClient(create_app(SETTINGS, registry), base_url="http://localhost") as client:
        [run] = client.get("/runs").json()
        waiting = client.get(f"/jobs/{spent['waiting']}").json()
        page = client.get(f"/ui/api/runs/{RUN}").json()
    assert run["cost"] == {
        "accelerator_seconds": 130.0,
        "accelerator_hours": 130.0 / 3600,
        "running_seconds": 120.0,
        "by_validator": {"default": 110.0, "v2": 20.0},
        "by_pool": {"A10G": 130.0},
        "by_accelerator_type": {"A10G": 130.0},
    }
    assert run["jobs"]["WAITING_FOR_RESOURCES"] == 1
    assert waiting["status"] == "WAITING_FOR_RESOURCES"
    assert waiting["waiting_for"]["fits"] == ["node type a10g"] and waiting["waiting_since"]
    assert page["cost"] == run["cost"]
    retried = next(job for job in page["jobs"] if job["id"] == spent["retried"])
    assert [a["accelerator_seconds"] for a in retried["attempts"]] == [30.0, 20.0]
    assert retried["attempts"][0]["accelerator_type"] == "A10G"


def test_metrics_count_accelerator_seconds_and_the_longest_wait_per_pool(registry, spent):
    with TestClient(create_app(SETTINGS, registry), base_url="http://localhost") as client:
        text = client.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    seconds = "ckval_validation_accelerator_seconds_total"
    labels = (("accelerator_type", "A10G"), ("pool", "A10G"))
    assert samples[(seconds, (*labels[:1], labels[1], ("validator", "default")))] == 110.0
    assert samples[(seconds, (*labels, ("validator", "v2")))] == 20.0
    jobs = ("ckval_jobs", (("pool", "A10G"), ("status", "WAITING_FOR_RESOURCES")))
    assert samples[jobs] == 1
    assert samples[("ckval_resource_wait_seconds", (("pool", "A10G"),))] >= 0
    assert samples[("ckval_leases", (("state", "live"),))] == 1  # the waiting job's lease


def test_waiting_for_a_run_says_which_jobs_wait_for_resources(registry, spent):
    from validation_service.progress import RunProgress

    with pytest.raises(TimeoutError, match="1 of them WAITING_FOR_RESOURCES: their Ray task"):
        registry.wait(RUN, timeout_s=0.05, poll_s=0.01)
    progress = RunProgress.from_counts(registry.job_counts(RUN))
    assert progress.waiting == 1
    assert "0 queued, 1 waiting for resources, 0 running" in progress.summary()
