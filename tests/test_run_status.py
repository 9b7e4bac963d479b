"""Run status and attempts: FINISHED / FAILED from a Ray Train run (RunStatusCallback) and
from a Client; a run name reused after the run ended starts attempt 2 (or appends); a
Ray Train run restarted after a worker failure goes on in its attempt."""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import click
import cloudpickle
import pytest
import ray.cloudpickle
import ray.train
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient

from trainer_integration import Client
from validation_service.api.registry import registry_router
from validation_service.cli.registry import run_rows, status_option
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _checkpoint(step: int) -> ray.train.Checkpoint:
    directory = tempfile.mkdtemp(prefix=f"ckval-status-{step}-")
    with open(os.path.join(directory, "state.txt"), "w") as f:
        f.write(str(step))
    return ray.train.Checkpoint.from_directory(directory)


def _read(checkpoint) -> str:
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "state.txt")) as f:
            return f.read()


def _statuses(registry: Registry, run: str) -> list[tuple[int, str]]:
    return [(a.attempt, a.status) for a in registry.run_attempts(run)]


def test_a_client_ends_its_run_finished_or_failed(unique_run):
    with Client(unique_run, start_service=False) as client:
        client.report({"accuracy": 0.5}, _checkpoint(0))
        assert _statuses(client.registry, unique_run) == [(1, "RUNNING")]
    registry = Registry()
    assert _statuses(registry, unique_run) == [(1, "FINISHED")]
    assert registry.run_attempts(unique_run)[0].ended_at is not None
    with pytest.raises(RuntimeError, match="training broke"):
        with Client(unique_run, start_service=False, append=True) as client:
            client.report({"accuracy": 0.6}, _checkpoint(1))
            raise RuntimeError("training broke")
    assert _statuses(registry, unique_run) == [(1, "FAILED")]
    assert [r.report_index for r in registry.checkpoints(unique_run)] == [0, 1]


def test_a_reused_run_name_starts_attempt_2_and_append_keeps_attempt_1(unique_run, caplog):
    with Client(unique_run, start_service=False) as client:
        for step, accuracy in enumerate([0.7, 0.9]):
            client.report({"accuracy": accuracy, "step": step}, _checkpoint(step))
    with caplog.at_level(logging.WARNING):
        with Client(unique_run, start_service=False) as client:
            assert client.report({"accuracy": 0.4, "step": 0}, _checkpoint(10)) == 0
    note = [r.getMessage() for r in caplog.records if "starting attempt 2" in r.getMessage()]
    assert len(note) == 1
    assert note[0].startswith(f"run {unique_run!r} ended (FINISHED) at ")
    assert "pass append=True / --append" in note[0] and "adding to attempt 1" in note[0]
    registry = Registry()
    assert _statuses(registry, unique_run) == [(1, "FINISHED"), (2, "FINISHED")]
    # The latest attempt by default; attempt 1 on request, its files untouched.
    assert [r.report_index for r in registry.checkpoints(unique_run)] == [0]
    [(best, metrics)] = registry.best_checkpoints(unique_run, "accuracy")
    assert (metrics["accuracy"], _read(best)) == (0.4, "10")
    assert _read(registry.latest_checkpoint(unique_run)) == "10"
    assert _read(registry.latest_checkpoint(unique_run, attempt=1)) == "1"
    [(best, metrics)] = registry.best_checkpoints(unique_run, "accuracy", attempt=1)
    assert (metrics["accuracy"], _read(best)) == (0.9, "1")
    with Client(unique_run, start_service=False, append=True) as client:
        assert client.report({"accuracy": 0.5}, _checkpoint(11)) == 1
    assert _statuses(registry, unique_run) == [(1, "FINISHED"), (2, "FINISHED")]
    assert [r.report_index for r in registry.checkpoints(unique_run)] == [0, 1]


def test_finish_run_and_the_status_filter(registry):
    registry.ledger.ensure_run("a", storage_root="/x")
    registry.ledger.ensure_run("b", storage_root="/x")
    assert registry.ledger.finish_run("a", "FAILED")
    assert not registry.ledger.finish_run("a", "FINISHED")  # ended already: nothing changes
    assert [r.name for r in registry.runs(status="RUNNING")] == ["b"]
    assert [(s.run.name, s.run.status) for s in registry.run_summaries(status="FAILED")] == [
        ("a", "FAILED")
    ]
    # A restarted reporter of a RUNNING run goes on in its attempt.
    assert registry.ledger.ensure_run("b", storage_root="/x") == registry.find_run_id("b")

    @click.command()
    @status_option
    def runs(status):
        headers, rows = run_rows(registry.run_summaries(status=status))
        click.echo(" ".join(headers))
        for row in rows:
            click.echo(f"{row[0]} {row[1]} {row[2]}")

    result = CliRunner().invoke(runs, ["--status", "failed"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == ["a 1 FAILED"]


def test_a_run_ends_only_as_finished_or_failed(registry):
    registry.ledger.ensure_run("a", storage_root="/x")
    with pytest.raises(InvalidInput, match="FINISHED or FAILED, not"):
        registry.ledger.finish_run("a", "RUNNING")
    with pytest.raises(InvalidInput, match="FINISHED or FAILED, not"):
        registry.ledger.finish_run("a", "DONE")
    assert [r.status for r in registry.runs()] == ["RUNNING"]


def test_an_unknown_status_filter_is_refused(registry):
    with pytest.raises(InvalidInput, match="run status must be one of RUNNING, FINISHED, FAILED"):
        registry.runs(status="done")


def test_an_attempt_that_does_not_exist_is_refused(registry):
    registry.ledger.ensure_run("a", storage_root="/x")
    with pytest.raises(InvalidInput, match="run 'a' has no attempt 3"):
        registry.checkpoints("a", attempt=3)


def test_run_status_routes(registry):
    registry.ledger.ensure_run("a", storage_root="/x")
    app = FastAPI()
    app.include_router(registry_router(registry, registry.settings))
    client = TestClient(app)
    body = client.get("/runs/a/status").json()
    assert (body["status"], body["attempt"], body["ended_at"]) == ("RUNNING", 1, None)
    response = client.post("/runs/a/finish", json={"status": "FINISHED"})
    assert response.status_code == 200, response.text
    assert (response.json()["status"], response.json()["changed"]) == ("FINISHED", True)
    assert client.post("/runs/a/finish", json={"status": "RUNNING"}).status_code == 422
    assert client.get("/runs/nope/status").status_code == 404
    registry.ledger.ensure_run("a", storage_root="/x")
    assert [a["attempt"] for a in client.get("/runs/a/attempts").json()] == [1, 2]


# ------------------------------------------------------------------ Ray Train
def train_and_maybe_fail(config) -> None:
    import ray.train

    from trainer_integration import report

    attempt_marker = os.path.join(config["scratch"], "failed-once")
    report({"step": 0}, _checkpoint(0))
    if config["fail"] == "always":
        raise RuntimeError("the train function failed")
    if config["fail"] == "once" and not os.path.exists(attempt_marker):
        open(attempt_marker, "w").close()
        raise RuntimeError("a worker failed; Ray Train restarts the worker group")
    ray.train.report({"done": 1})


def _fit(run: str, home, scratch, fail: str, max_failures: int = 0):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainer_integration import RunStatusCallback

    return TorchTrainer(
        train_and_maybe_fail,
        train_loop_config={"scratch": str(scratch), "fail": fail},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            name=run,
            storage_path=str(home / "ray_results"),
            callbacks=[RunStatusCallback()],
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    ).fit()


@pytest.mark.ray
def test_a_ray_train_run_that_fails_is_failed(service, session_home, unique_run, tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - Ray Train's error class wraps the worker's
        _fit(unique_run, session_home, tmp_path, "always")
    assert _statuses(Registry(), unique_run) == [(1, "FAILED")]


@pytest.mark.ray
def test_a_restarted_ray_train_run_goes_on_in_its_attempt_and_ends_finished(
    service, session_home, unique_run, tmp_path
):
    """A worker fails once and the group restarts: the run stays in its first attempt, and
    RunStatusCallback marks it FINISHED when the Ray Train run succeeds (the demo's run,
    which never restarts, ends FINISHED too: tests/test_examples.py)."""
    result = _fit(unique_run, session_home, tmp_path, "once", max_failures=1)
    assert result.error is None
    registry = Registry()
    assert _statuses(registry, unique_run) == [(1, "FINISHED")]
    assert [r.report_index for r in registry.checkpoints(unique_run)] == [0, 1]
