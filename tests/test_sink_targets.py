"""The sinks log only into tracker runs they created themselves for the ckval run, or
that their settings allow (CKVAL_MLFLOW_ALLOWED_EXPERIMENTS, CKVAL_WANDB_ALLOWED_ENTITIES);
any other run a reporter recorded gets nothing, and the metrics go to the sink's own run
with a warning naming the job. Real MLflow tracking stores on SQLite, the sinks called as
the service calls them."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from validation_service.config import Settings
from validation_service.sinks import ValidatedMetrics

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
def wandb_target(recorded: dict, **settings) -> dict:
    """The run a W&B sink with these settings would log a validation to (wandb.init's
    arguments), for a ckval run whose reporter recorded ``recorded``."""
    pytest.importorskip("wandb")
    from validation_service.sinks.wandb import WandbSink

    sink = WandbSink(allowed_entities=Settings(**settings).wandb_allowed_entities)
    item = dataclasses.replace(validated("x", "u"), trackers={"wandb": recorded})
    return sink._target(item)


def test_a_recorded_wandb_run_of_an_entity_not_allowed_is_not_resumed(caplog):
    recorded = {"id": "abc123", "project": "secret", "entity": "team-b"}
    with caplog.at_level(logging.WARNING, logger="validation_service.sinks"):
        target = wandb_target(recorded)
    assert target["id"].startswith("ckval-") and target["project"] == "ckval"
    assert any("validation job 7" in r.getMessage() for r in caplog.records)


def test_a_recorded_wandb_run_of_an_allowed_entity_is_resumed():
    recorded = {"id": "abc123", "project": "digits", "entity": "team-a"}
    target = wandb_target(recorded, wandb_allowed_entities=["team-a"])
    assert (target["id"], target["entity"], target["project"]) == ("abc123", "team-a", "digits")


def test_another_ckval_runs_own_wandb_run_is_never_resumed():
    recorded = {"id": "ckval-0123456789abcdef", "entity": "team-a"}
    target = wandb_target(recorded, wandb_allowed_entities=["*"])
    assert target["id"] != recorded["id"] and target["id"].startswith("ckval-")
