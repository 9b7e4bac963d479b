"""should_stop(): the registry's stop decision reaching training, on real training.

A 2-worker TorchTrainer (SQLite and PostgreSQL), Keras fit() with the callback, and Dask
DDP ranks stop at the same epoch on every rank once the run's stop policy decided; a run
whose validations all fail never stops. The validated metric is a function of the
checkpoint's epoch (read from a file in the checkpoint), so the deciding checkpoint is
known in advance: the metric improves until PLATEAU_EPOCH and stays flat after it.

The lag: validation is asynchronous, so a loop `report(); if should_stop(): break` goes on
for some epochs after the deciding checkpoint was reported, while that checkpoint (and
those before it, judged in report order) are validated and the watcher reads the
decision (at most a second later). A loop never stops *before* the deciding checkpoint
(the decision does not exist yet); it must stop within LAG_S of training time after it:
on this 2-core machine a validation's Ray task takes up to a few seconds when its worker
process starts cold, plus the watcher's 1 s poll.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import uuid

import cloudpickle
import pytest
import ray.cloudpickle

from trainer_integration import should_stop
from trainer_integration._reporter import RunReporter
from trainer_integration._stopping import forget, watch
from validation_service import StopPolicy
from validation_service.config import Settings
from validation_service.errors import InvalidInput, ValidationsFailedWarning
from validation_service.registry.registry import Registry

# Ray workers and the service cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PLATEAU_EPOCH = 2  # the score improves up to this epoch, then stays flat
PATIENCE = 2  # -> the policy decides on checkpoint PLATEAU_EPOCH + PATIENCE
STEP_S = 0.4  # one training epoch
LAG_S = 8.0  # training time allowed between the deciding report and the stop
LAG_EPOCHS = math.ceil(LAG_S / STEP_S)
EPOCHS = PLATEAU_EPOCH + PATIENCE + LAG_EPOCHS + 5  # room to show it did stop


def score_of_epoch(epoch: int) -> float:
    return min(epoch, PLATEAU_EPOCH) / 10


def plateau_score(checkpoint, config) -> dict:
    """The validate_fn: the score of the epoch written in the checkpoint."""
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "epoch.json")) as f:
            epoch = json.load(f)["epoch"]
    return {"score": score_of_epoch(epoch)}


def always_fails(checkpoint, config) -> dict:
    raise RuntimeError("the validation set is unreachable")


def write_checkpoint(directory: str, epoch: int, state: dict | None = None) -> None:
    with open(os.path.join(directory, "epoch.json"), "w") as f:
        json.dump({"epoch": epoch}, f)
    if state is not None:
        import torch

        torch.save(state, os.path.join(directory, "model.pt"))


def record_stop(out: str, rank: int, stopped_at: int | None, epochs_run: int) -> None:
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"stopped_at": stopped_at, "epochs_run": epochs_run}, f)


def read_stops(out) -> dict[int, dict]:
    return {
        int(name[5:-5]): json.loads((out / name).read_text())
        for name in os.listdir(out)
        if name.startswith("rank-")
    }


# ------------------------------------------------------------------ without Ray
def test_should_stop_without_a_run_says_what_to_pass():
    with pytest.raises(InvalidInput, match=r"should_stop\(run='my-run'\).*start_run"):
        should_stop()


def test_the_watcher_reads_the_decision_and_the_override(registry, tmp_path):
    """The background watcher of a run (its registry opened off the training thread):
    False before any decision, True once the policy decided, False once overridden."""
    from tests.registry_world import report as register
    from tests.test_stop_policy import Scheduler
    from validation_service.storage import CheckpointStorage

    run = f"watched-{uuid.uuid4().hex[:6]}"
    url = registry.engine.url.render_as_string(hide_password=False)
    reporter = RunReporter(
        run, Settings(database_url=url, home=tmp_path, poll_interval_s=0.1), start_service=False
    )
    watcher = watch(run, reporter)
    assert watcher.wait_for_first_look(30)
    assert should_stop(run=run) is False
    registry.set_stop_policy(run, StopPolicy("score", patience=1))
    storage = CheckpointStorage(str(tmp_path / "storage"))
    register(registry, storage, run, [{}, {}], validate=True, workdir=tmp_path)
    Scheduler(registry).finish(run, {0: {"score": 0.5}, 1: {"score": 0.4}})
    assert registry.stop_decision(run).stopped
    _wait_for(lambda: should_stop(run=run), "the decision to reach should_stop()")
    registry.resume_despite_stop(run)
    _wait_for(lambda: not should_stop(run=run), "the override to reach should_stop()")
    forget(run)
    reporter.close()


@pytest.mark.postgres
def test_a_registry_it_cannot_read_is_said_once_and_its_return_too(
    postgres_server_url, tmp_path, caplog
):
    """A real outage (the registry's connections cut, new ones refused): should_stop()
    warns once, naming the reason, keeps its last answer, and says when it reads again."""
    import sqlalchemy as sa

    from tests.tcp_proxy import TcpProxy

    Registry(postgres_server_url, upgrade=True).close()
    url = sa.engine.make_url(postgres_server_url)
    proxy = TcpProxy(url.host, url.port or 5432)
    proxy.start()
    through_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    run = f"outage-{uuid.uuid4().hex[:6]}"
    settings = Settings(database_url=through_proxy, home=tmp_path, poll_interval_s=0.05)
    reporter = RunReporter(run, settings, start_service=False)
    logger = "trainer_integration._stopping"
    try:
        watcher = watch(run, reporter)
        assert watcher.wait_for_first_look(30)
        with caplog.at_level("WARNING", logger=logger):
            proxy.stop()
            _wait_for(lambda: _said(caplog, "cannot read run"), "the outage's warning")
            time.sleep(3)  # several more looks fail meanwhile (one at most every 2 s)
            assert should_stop(run=run) is False  # its last answer
            proxy.start()
            _wait_for(lambda: _said(caplog, "is read again"), "the registry's return", 60)
        outage = [r.getMessage() for r in caplog.records if "cannot read run" in r.getMessage()]
        assert len(outage) == 1, outage
        assert repr(run) in outage[0] and "answers False until it can" in outage[0]
    finally:
        forget(run)
        reporter.close()
        proxy.stop()


def _said(caplog, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ------------------------------------------------------------------ Ray Train
def train_until_told(config):
    """Every rank: one DDP step per epoch, report (rank 0 with the checkpoint), then ask."""
    import ray.train
    import ray.train.torch
    import torch

    from trainer_integration import report

    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stopped_at, epoch = None, -1
    for epoch in range(config["epochs"]):
        optimizer.zero_grad()
        model(torch.ones(8, 4)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(STEP_S)
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                write_checkpoint(tmp, epoch, model.module.state_dict())
                report(
                    {"epoch": epoch},
                    ray.train.Checkpoint.from_directory(tmp),
                    validate_fn=config["validate_fn"],
                    max_attempts=1,
                )
        else:
            report({"epoch": epoch}, None)
        if should_stop():
            stopped_at = epoch
            break
    record_stop(config["out"], rank, stopped_at, epoch + 1)


def fit_torch(run: str, session_home, out, *, epochs=EPOCHS, env=None, **config) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_until_told,
        train_loop_config={"epochs": epochs, "out": str(out), **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run,
            storage_path=str(session_home / "ray_results"),
            worker_runtime_env={"env_vars": env} if env else None,
        ),
    )
    assert trainer.fit().error is None


def assert_stopped_together(out, deciding_index: int) -> int:
    """Both ranks stopped at the same epoch, not before the deciding checkpoint and
    within LAG_EPOCHS after it; returns that epoch."""
    stops = read_stops(out)
    assert set(stops) == {0, 1}
    assert stops[0] == stops[1], stops
    stopped_at = stops[0]["stopped_at"]
    assert stopped_at is not None, f"never stopped in {EPOCHS} epochs"
    assert deciding_index <= stopped_at <= deciding_index + LAG_EPOCHS, stops
    return stopped_at


@pytest.fixture
def postgres_service(service, postgres_server_url):
    """A service of its own on PostgreSQL, and the workers' environment for it (the
    session's service, on SQLite, serves the threshold and failing runs below)."""
    from validation_service.config import ckval_env, get_settings
    from validation_service.service import ValidationService

    name = f"ckval-pg-{uuid.uuid4().hex[:6]}"
    registry = Registry(postgres_server_url, upgrade=True)
    handle = ValidationService.start(
        settings=get_settings(database_url=postgres_server_url, service_name=name)
    )
    env = {**ckval_env(), "CKVAL_DATABASE_URL": postgres_server_url, "CKVAL_SERVICE_NAME": name}
    try:
        yield registry, env
    finally:
        registry.close()
        handle.stop()


@pytest.mark.ray
@pytest.mark.postgres
def test_torch_trainer_stops_on_patience_on_every_rank(
    postgres_service, session_home, unique_run, tmp_path
):
    registry, env = postgres_service
    registry.set_stop_policy(unique_run, StopPolicy("score", patience=PATIENCE))
    fit_torch(unique_run, session_home, tmp_path, env=env, validate_fn=plateau_score)

    decision = registry.stop_decision(unique_run)
    assert decision is not None and decision.stopped and decision.rule == "patience"
    assert decision.report_index == PLATEAU_EPOCH + PATIENCE
    stopped_at = assert_stopped_together(tmp_path, decision.report_index)
    # the final reports' validations finish and are merged after the stop
    registry.wait(unique_run, timeout_s=120)
    records = registry.checkpoints(unique_run)
    assert len(records) == stopped_at + 1
    assert [r.metrics["score"] for r in records] == [score_of_epoch(e) for e in range(len(records))]


@pytest.mark.ray
def test_torch_trainer_stops_on_a_threshold(service, session_home, unique_run, tmp_path):
    registry = Registry()
    registry.set_stop_policy(unique_run, StopPolicy("score", threshold=score_of_epoch(1)))
    fit_torch(unique_run, session_home, tmp_path, validate_fn=plateau_score)
    decision = registry.stop_decision(unique_run)
    assert (decision.rule, decision.report_index) == ("threshold", 1)
    assert_stopped_together(tmp_path, 1)


@pytest.mark.ray
def test_a_run_whose_validations_all_fail_never_stops(service, session_home, unique_run, tmp_path):
    registry = Registry()
    registry.set_stop_policy(unique_run, StopPolicy("score", patience=1))
    epochs = 5
    fit_torch(unique_run, session_home, tmp_path, epochs=epochs, validate_fn=always_fails)
    assert read_stops(tmp_path) == {r: {"stopped_at": None, "epochs_run": epochs} for r in (0, 1)}
    with pytest.warns(ValidationsFailedWarning, match=f"{epochs} of {epochs} validation"):
        registry.wait(unique_run, timeout_s=120)
    assert [r.validation_status for r in registry.checkpoints(unique_run)] == ["FAILED"] * epochs
    assert registry.stop_decision(unique_run) is None


# ------------------------------------------------------------------ Keras
def constant_score(checkpoint, config) -> dict:
    return {"score": 1.0}  # never improves after the first: patience decides


@pytest.mark.ray
def test_keras_callback_sets_stop_training(service, unique_run):
    import keras
    import numpy as np

    import trainer_integration.keras as ckval_keras

    Registry().set_stop_policy(unique_run, StopPolicy("score", patience=PATIENCE))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    slow = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: time.sleep(STEP_S))
    callback = ckval_keras.ReportCheckpointCallback(validate_fn=constant_score, run=unique_run)
    x = np.arange(20, dtype=np.float32) / 20
    history = model.fit(x, 2 * x, epochs=EPOCHS, callbacks=[slow, callback], verbose=0)

    registry = Registry()
    decision = registry.stop_decision(unique_run)
    assert (decision.rule, decision.report_index) == ("patience", PATIENCE)
    epochs_run = len(history.history["loss"])
    assert PATIENCE + 1 <= epochs_run <= PATIENCE + 1 + LAG_EPOCHS
    registry.wait(unique_run, timeout_s=120)
    assert len(registry.checkpoints(unique_run)) == epochs_run


# ------------------------------------------------------------------ Dask
def dask_train_until_told(epochs: int, workdir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from ray.train import Checkpoint

    import trainer_integration

    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stopped_at, epoch = None, -1
    for epoch in range(epochs):
        optimizer.zero_grad()
        model(torch.ones(8, 4)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(STEP_S)
        if rank == 0:
            directory = os.path.join(workdir, f"epoch-{epoch}")
            os.makedirs(directory)
            write_checkpoint(directory, epoch, model.module.state_dict())
            trainer_integration.report(
                {"epoch": epoch}, Checkpoint.from_directory(directory), validate_fn=plateau_score
            )
        else:
            trainer_integration.report({"epoch": epoch}, None)
        if trainer_integration.should_stop():
            stopped_at = epoch
            break
    record_stop(out, rank, stopped_at, epoch + 1)


@pytest.mark.ray
def test_dask_ranks_stop_at_the_same_epoch(service, unique_run, tmp_path):
    from distributed import Client, LocalCluster

    from trainer_integration.dask import run

    Registry().set_stop_policy(unique_run, StopPolicy("score", patience=PATIENCE))
    out = tmp_path / "out"
    out.mkdir()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        futures = run(
            client,
            dask_train_until_told,
            run_name=unique_run,
            epochs=EPOCHS,
            workdir=str(tmp_path),
            out=str(out),
        )
        client.gather(futures)
    decision = Registry().stop_decision(unique_run)
    assert decision.report_index == PLATEAU_EPOCH + PATIENCE
    assert_stopped_together(out, decision.report_index)
