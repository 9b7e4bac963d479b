"""The sinks log only into tracker runs they created themselves for the ckval run, or
that their settings allow (CKVAL_MLFLOW_ALLOWED_EXPERIMENTS, CKVAL_WANDB_ALLOWED_ENTITIES);
any other run a reporter recorded gets nothing, and the metrics go to the sink's own run
with a warning naming the job, stored with the job (`ckval job N`, `/jobs/N`). Real
MLflow tracking stores on SQLite and W&B in offline mode, the sinks called as the service
calls them: on their own, and through the scheduler's dispatcher after a job's finish on a
SQLite and a PostgreSQL registry."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from validation_service.api import create_app
from validation_service.cli import main as ckval
from validation_service.config import Settings
from validation_service.registry.records import ClaimedJob, JobOutcome
from validation_service.registry.registry import Registry
from validation_service.request import ValidationRequest
from validation_service.sinks import SinkDispatcher, ValidatedMetrics

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    """(the service's MLflow URI, team B's run in experiment "team-b" there)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    team_b = client.create_run(client.create_experiment("team-b")).info.run_id
    yield uri, team_b
    mlflow.set_tracking_uri(None)


def validated(run_id: str, uri: str, job_id: int = 7) -> ValidatedMetrics:
    """A validation of namespace A's run "a-run" whose reporter recorded ``run_id``."""
    return ValidatedMetrics(
        job_id=job_id,
        run="a-run",
        namespace="team-a",
        report_index=0,
        step=3,
        metrics={"accuracy": 0.5},
        checkpoint_uri="/nowhere",
        trackers={"mlflow": {"run_id": run_id, "tracking_uri": uri}},
    )


def sink_for(settings: Settings):
    from validation_service.sinks.mlflow import MlflowSink

    return MlflowSink(allowed_experiments=settings.mlflow_allowed_experiments)


def test_a_recorded_run_of_another_experiment_gets_nothing(tracking, caplog):
    uri, team_b = tracking
    sink = sink_for(Settings())

    with caplog.at_level(logging.WARNING, logger="validation_service.sinks"):
        sink.log([validated(team_b, uri)])

    client = mlflow.MlflowClient(uri)
    assert client.get_metric_history(team_b, "accuracy") == []
    [own] = client.search_runs([client.get_experiment_by_name("ckval").experiment_id])
    assert own.info.run_name == "a-run"
    assert [(m.step, m.value) for m in client.get_metric_history(own.info.run_id, "accuracy")] == [
        (3, 0.5)
    ]
    [warning] = [r.getMessage() for r in caplog.records if "CKVAL_MLFLOW_ALLOWED" in r.getMessage()]
    assert "validation job 7" in warning and team_b in warning


def test_a_recorded_run_of_an_allowed_experiment_gets_the_metrics(tracking, monkeypatch):
    uri, team_b = tracking
    monkeypatch.setenv("CKVAL_MLFLOW_ALLOWED_EXPERIMENTS", "team-b")
    sink_for(Settings()).log([validated(team_b, uri)])
    history = mlflow.MlflowClient(uri).get_metric_history(team_b, "accuracy")
    assert [(m.step, m.value) for m in history] == [(3, 0.5)]


def test_the_sinks_own_run_of_another_namespace_is_not_written_by_a_recorded_id(tracking):
    uri, _ = tracking
    sink = sink_for(Settings())
    other = dataclasses.replace(validated("x", uri), namespace="team-c", trackers={})
    sink.log([other])  # the sink makes team C's own run
    client = mlflow.MlflowClient(uri)
    [team_c_run] = client.search_runs([client.get_experiment_by_name("ckval").experiment_id])

    sink.log([validated(team_c_run.info.run_id, uri, job_id=8)])

    history = client.get_metric_history(team_c_run.info.run_id, "accuracy")
    assert len(history) == 1  # team C's own validation only


# ------------------------------------------------------------------ W&B
def wandb_target(recorded: dict, **settings) -> tuple[dict, str | None]:
    """The run a W&B sink with these settings would log a validation to (wandb.init's
    arguments), for a ckval run whose reporter recorded ``recorded``, and its warning."""
    pytest.importorskip("wandb")
    from validation_service.sinks.wandb import WandbSink

    sink = WandbSink(allowed_entities=Settings(**settings).wandb_allowed_entities)
    item = dataclasses.replace(validated("x", "u"), trackers={"wandb": recorded})
    return sink._target(item)


def test_a_recorded_wandb_run_of_an_entity_not_allowed_is_not_resumed():
    recorded = {"id": "abc123", "project": "secret", "entity": "team-b"}
    target, warning = wandb_target(recorded)
    assert target["id"].startswith("ckval-") and target["project"] == "ckval"
    assert "'abc123' of entity 'team-b'" in warning and "CKVAL_WANDB_ALLOWED" in warning


def test_a_recorded_wandb_run_of_an_allowed_entity_is_resumed():
    recorded = {"id": "abc123", "project": "digits", "entity": "team-a"}
    target, warning = wandb_target(recorded, wandb_allowed_entities=["team-a"])
    assert warning is None
    assert (target["id"], target["entity"], target["project"]) == ("abc123", "team-a", "digits")


def test_another_ckval_runs_own_wandb_run_is_never_resumed():
    recorded = {"id": "ckval-0123456789abcdef", "entity": "team-a"}
    target, _ = wandb_target(recorded, wandb_allowed_entities=["*"])
    assert target["id"] != recorded["id"] and target["id"].startswith("ckval-")


# ------------------------------------------- the warning stored with the job
REQUEST = ValidationRequest(
    executor_kind="ray_task", pool="CPU", validate_fn_name="v", validate_fn_ref="json:dumps"
)


def succeeded_job(registry: Registry, trackers: dict) -> ClaimedJob:
    """A job of the run "a-run", whose reporter recorded ``trackers``, claimed and
    finished SUCCEEDED as the scheduler does (no Ray: the outcome is given)."""
    run_id = registry.ledger.ensure_run("a-run", storage_root="/nowhere")
    registry.ledger.register_checkpoint(
        run_id,
        0,
        uri="/nowhere/a-run/0",
        size_bytes=1,
        manifest_sha256=None,
        reported_metrics={"step": 3},
        job=REQUEST,
    )
    registry.ledger.tag_run(run_id, {"trackers": trackers})
    [claimed] = registry.job_queue.claim_due_jobs("test", {"CPU": 1}, lease_s=60)
    outcome = JobOutcome(succeeded=True, metrics={"accuracy": 0.5})
    assert registry.job_queue.finish_job(claimed.job_id, claimed.lease_token, outcome)
    return claimed


def dispatch(registry: Registry, job: ClaimedJob, sink: dict) -> dict[str, int]:
    """The scheduler's dispatcher logs the job's metrics to ``sink``; its stats."""
    stats: dict[str, int] = {}
    settings = Settings(sinks=[sink], sink_attempts=1)
    dispatcher = SinkDispatcher.from_settings(settings, registry.job_queue, stats)
    dispatcher.submit(job)
    assert dispatcher.wait_idle(60)
    dispatcher.close()
    return stats


def shown_warnings(registry: Registry, job_id: int) -> tuple[list[str], str, list[str]]:
    """The job's warnings as the registry, `ckval job N` and `/jobs/N` show them."""
    url = registry.engine.url.render_as_string(hide_password=False)
    cli = CliRunner().invoke(ckval, ["--database-url", url, "job", str(job_id)])
    assert cli.exit_code == 0, cli.output
    settings = Settings(database_url=url, namespace=registry.namespace)
    with TestClient(create_app(settings, registry), base_url="http://localhost") as client:
        answer = client.get(f"/jobs/{job_id}")
    assert answer.status_code == 200, answer.text
    return list(registry.get_job(job_id).warnings), cli.output, answer.json()["warnings"]


def test_a_recorded_mlflow_run_not_allowed_is_a_warning_stored_with_the_job(registry, tracking):
    uri, team_b = tracking
    job = succeeded_job(registry, {"mlflow": {"run_id": team_b, "tracking_uri": uri}})

    stats = dispatch(registry, job, {"kind": "mlflow"})

    assert stats == {"sink_deliveries": 1, "sink_failures": 0}
    assert registry.get_job(job.job_id).status == "SUCCEEDED"
    assert mlflow.MlflowClient(uri).get_metric_history(team_b, "accuracy") == []
    stored, cli_output, api_warnings = shown_warnings(registry, job.job_id)
    [warning] = stored
    assert warning.startswith(f"sink mlflow: not logged to the MLflow run {team_b}")
    assert "CKVAL_MLFLOW_ALLOWED_EXPERIMENTS" in warning
    assert f"warning: {warning}" in cli_output
    assert api_warnings == [warning]


def test_a_recorded_wandb_entity_not_allowed_is_a_warning_stored_with_the_job(
    registry, tmp_path, monkeypatch
):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recorded = {"id": "abc123", "project": "secret", "entity": "team-b"}
    job = succeeded_job(registry, {"wandb": recorded})

    sink = {"kind": "wandb", "mode": "offline", "dir": str(tmp_path)}
    stats = dispatch(registry, job, sink)

    assert stats == {"sink_deliveries": 1, "sink_failures": 0}
    assert registry.get_job(job.job_id).status == "SUCCEEDED"
    stored, cli_output, api_warnings = shown_warnings(registry, job.job_id)
    [warning] = stored
    assert warning.startswith("sink wandb: not logged to the W&B run 'abc123' of entity")
    assert f"warning: {warning}" in cli_output
    assert api_warnings == [warning]
    # The sink's own offline run got the metrics; nothing was written as the recorded one.
    [own] = [path.name for path in (tmp_path / "wandb").glob("offline-run-*")]
    assert "-ckval-" in own and "abc123" not in own, own


def test_a_warning_is_stored_once_and_other_jobs_keep_none(registry):
    job = succeeded_job(registry, {})
    for _ in range(2):
        assert registry.job_queue.add_warnings(job.job_id, ["sink x: logged elsewhere"])
    assert registry.get_job(job.job_id).warnings == ("sink x: logged elsewhere",)
    assert not registry.job_queue.add_warnings(job.job_id + 1, ["no such job"])
    [listed] = registry.list_jobs()
    assert listed.warnings == ("sink x: logged elsewhere",)
