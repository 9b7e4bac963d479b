"""Real PyTorch Lightning on CPU: the Callback in Ray Train (RayDDPStrategy, 2 workers) and
in a plain script; validated metrics drive Lightning's ModelCheckpoint and EarlyStopping."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle

if importlib.util.find_spec("lightning") is None:
    pytest.skip(
        'Lightning is not installed: pip install "ckval[lightning]"', allow_module_level=True
    )

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from trainer_integration import CheckpointUploadMode
from trainer_integration.lightning import CHECKPOINT_NAME, ReportCheckpointCallback
from validation_service.cli.demo import load_digits_split, make_model
from validation_service.context import current_validation
from validation_service.errors import InvalidInput, ValidationsFailedWarning
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

# Ray workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DigitsModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def digits_loader(rank: int = 0, world: int = 1) -> torch.utils.data.DataLoader:
    x, _, y, _ = load_digits_split()
    shard = torch.utils.data.TensorDataset(
        torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world]).long()
    )
    return torch.utils.data.DataLoader(shard, batch_size=64)


def stored_state(checkpoint_dir: str) -> dict:
    saved = torch.load(os.path.join(checkpoint_dir, CHECKPOINT_NAME), weights_only=False)
    return {name.removeprefix("model."): value for name, value in saved["state_dict"].items()}


def validate_val_acc(checkpoint, config):
    """The validate_fn: held-out accuracy of the Lightning checkpoint's weights."""
    if current_validation().report_index == config.get("fail_index"):
        raise RuntimeError("held-out digits unavailable for this checkpoint")
    model = make_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(stored_state(directory))
    _, x_val, _, y_val = load_digits_split()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return {"val_acc": float(np.mean(predicted == y_val))}


def accuracy_by_hand(checkpoint_dir: str) -> float:
    """The same accuracy without torch modules: numpy on the stored weights."""
    state = {name: value.numpy() for name, value in stored_state(checkpoint_dir).items()}
    _, x_val, _, y_val = load_digits_split()
    hidden = np.maximum(x_val @ state["0.weight"].T + state["0.bias"], 0)
    logits = hidden @ state["2.weight"].T + state["2.bias"]
    return float(np.mean(logits.argmax(axis=1) == y_val))


class WaitForValidation(pl.Callback):
    """From epoch ``first`` on, holds each epoch's start (on the reporting rank) until the
    previous epoch's checkpoint has come back validated: its value is then fed at this
    epoch's end, deterministically."""

    def __init__(self, ckval_callback: ReportCheckpointCallback, first: int = 1, offset: int = 0):
        self.ckval_callback, self.first, self.offset = ckval_callback, first, offset

    def on_train_epoch_start(self, trainer, pl_module):
        index = trainer.current_epoch - 1 - self.offset
        if not trainer.is_global_zero or trainer.current_epoch - self.offset < self.first:
            return
        deadline = time.monotonic() + 120
        while index not in self.ckval_callback.received:
            assert time.monotonic() < deadline, f"checkpoint {index} not validated in 120 s"
            time.sleep(0.05)


class RecordCallbackMetrics(pl.Callback):
    """Writes what each rank's callback_metrics held at each epoch end, and the
    ModelCheckpoint's choice, to <folder>/rank-<r>.json."""

    def __init__(self, folder: str, model_checkpoint: ModelCheckpoint):
        self.folder, self.model_checkpoint, self.seen = folder, model_checkpoint, []

    def on_train_epoch_end(self, trainer, pl_module):
        value = trainer.callback_metrics.get("val_acc")
        self.seen.append(None if value is None else float(value))

    def on_train_end(self, trainer, pl_module):
        best = self.model_checkpoint.best_model_score
        record = {
            "val_acc": self.seen,
            "best_score": None if best is None else float(best),
            "best_path": os.path.basename(self.model_checkpoint.best_model_path),
        }
        with open(os.path.join(self.folder, f"rank-{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def train_in_ray_train(config):
    """Ray's Lightning guide with ckval's callback instead of RayTrainReportCallback."""
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    torch.manual_seed(0)
    context = ray.train.get_context()
    callback = ReportCheckpointCallback(validate_fn=validate_val_acc, poll_interval_s=0.1)
    best = ModelCheckpoint(dirpath=config["checkpoints"], monitor="val_acc", mode="max")
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[
            callback,
            WaitForValidation(callback),
            RecordCallbackMetrics(config["records"], best),
            best,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(DigitsModule(), digits_loader(context.get_world_rank(), context.get_world_size()))


@pytest.fixture(scope="module")
def ray_train_run(service, session_home, tmp_path_factory):
    """One 2-worker TorchTrainer run of 3 epochs; each rank records its callback_metrics."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"lightning-ray-train-{os.getpid()}"
    records = tmp_path_factory.mktemp("lightning-records")
    result = TorchTrainer(
        train_in_ray_train,
        train_loop_config={
            "epochs": 3,
            "records": str(records),
            "checkpoints": str(tmp_path_factory.mktemp("lightning-model-checkpoint")),
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(session_home / "ray_results")),
    ).fit()
    Registry().wait(name, timeout_s=180)
    ranks = [json.loads((records / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    return name, result, ranks


def test_ray_train_reports_each_epoch_and_validates_it(ray_train_run):
    name, result, _ = ray_train_run
    assert result.error is None
    records = Registry().checkpoints(name)
    assert [(r.report_index, r.epoch) for r in records] == [(0, 0), (1, 1), (2, 2)]
    assert [r.validation_status for r in records] == ["VALIDATED"] * 3
    for record in records:
        assert record.metrics["val_acc"] == pytest.approx(accuracy_by_hand(record.uri), abs=1e-9)
        assert set(record.reported_metrics) == {"train_loss", "epoch", "step"}
    assert records[-1].metrics["val_acc"] > records[0].metrics["val_acc"]


def test_validated_metrics_reach_every_rank_and_drive_model_checkpoint(ray_train_run):
    name, _, ranks = ray_train_run
    validated = [r.metrics["val_acc"] for r in Registry().checkpoints(name)]
    # Epoch e's end saw checkpoint e-1's validated accuracy, the same on both ranks.
    expected = [None, pytest.approx(validated[0], abs=1e-6), pytest.approx(validated[1], abs=1e-6)]
    assert ranks[0]["val_acc"] == expected and ranks[1]["val_acc"] == ranks[0]["val_acc"]
    # ModelCheckpoint(monitor="val_acc") kept the model when the best validated value came.
    best_epoch = 1 if validated[0] >= validated[1] else 2
    assert ranks[0]["best_score"] == pytest.approx(max(validated[:2]), abs=1e-6)
    assert ranks[0]["best_path"].startswith(f"epoch={best_epoch}-")


def test_plain_script_early_stopping_failing_validation_and_resume(
    ray_train_run, service, unique_run, tmp_path
):
    """Outside Ray Train (run=...), resumed from the Ray Train run's latest checkpoint: the
    first validation fails (training goes on), EarlyStopping stops on the first value."""
    name, _, _ = ray_train_run
    registry = Registry()
    latest = registry.latest_checkpoint(name)
    callback = ReportCheckpointCallback(
        validate_fn=validate_val_acc,
        validate_config={"fail_index": 0},
        run=unique_run,
        poll_interval_s=0.1,
        max_attempts=1,
    )
    # strict=False: the first epochs end before any validated value has come back.
    stop = EarlyStopping(
        monitor="val_acc",
        mode="max",
        stopping_threshold=0.0,
        check_on_train_epoch_end=True,
        strict=False,
    )
    trainer = pl.Trainer(
        max_epochs=10,
        accelerator="cpu",
        callbacks=[callback, WaitForValidation(callback, first=2, offset=3), stop],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with latest.as_directory() as directory:
        trainer.fit(
            DigitsModule(), digits_loader(), ckpt_path=os.path.join(directory, CHECKPOINT_NAME)
        )
    with pytest.warns(ValidationsFailedWarning):
        received = callback.wait(timeout_s=120)

    records = registry.checkpoints(unique_run)
    # Resumed after the Ray Train run's 3 epochs; stopped once checkpoint 1's value came.
    assert [r.epoch for r in records] == [3, 4, 5]
    assert trainer.should_stop and stop.stopped_epoch == 5
    assert [r.validation_status for r in records] == ["FAILED", "VALIDATED", "VALIDATED"]
    [failed] = [job for job in registry.validations(unique_run) if job.status == "FAILED"]
    assert failed.error_message == "held-out digits unavailable for this checkpoint"
    assert sorted(received) == [1, 2]
    for index in (1, 2):
        assert received[index]["val_acc"] == pytest.approx(
            accuracy_by_hand(records[index].uri), abs=1e-9
        )
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(
        received[2]["val_acc"], abs=1e-6
    )
    assert registry.dashboard.run_view(unique_run).record.status == "FINISHED"  # ended with fit()


def test_bad_arguments_are_refused_before_training(unique_run):
    with pytest.raises(InvalidInput, match="every_n_train_steps must be None"):
        ReportCheckpointCallback(every_n_train_steps=0, run=unique_run)
    with pytest.raises(InvalidInput, match="poll_interval_s must be a number > 0"):
        ReportCheckpointCallback(poll_interval_s=0, run=unique_run)
    with pytest.raises(InvalidInput, match="not in ckval's storage: use CheckpointUploadMode.SYNC"):
        ReportCheckpointCallback(
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD, run=unique_run
        )
    with pytest.raises(InvalidInput, match="validate_config and validation_resources need a"):
        ReportCheckpointCallback(validate_config={"a": 1}, run=unique_run)
    with pytest.raises(InvalidInput, match="cannot be pickled.*Define it at module level"):
        ReportCheckpointCallback(
            validate_fn=lambda c, cfg, lock=__import__("threading").Lock(): {}, run=unique_run
        )
    assert Registry().find_run_id(unique_run) is None


class WritesNothing(pl.plugins.io.CheckpointIO):
    """A CheckpointIO plugin that loses every checkpoint."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        pass

    def load_checkpoint(self, path, map_location=None):
        raise FileNotFoundError(path)

    def remove_checkpoint(self, path):
        pass


def test_a_save_that_writes_no_checkpoint_is_refused(unique_run):
    callback = ReportCheckpointCallback(validate_fn=validate_val_acc, run=unique_run)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[callback],
        plugins=[WritesNothing()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(InvalidInput, match="wrote nothing at step 22: nothing was reported"):
        trainer.fit(DigitsModule(), digits_loader())
    assert Registry().find_run_id(unique_run) is None


def test_every_n_train_steps_reports_within_epochs(service, unique_run):
    callback = ReportCheckpointCallback(
        every_n_train_steps=10, validate_fn=validate_val_acc, run=unique_run
    )
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsModule(), digits_loader())  # 22 steps: reports at 10 and 20
    callback.wait(timeout_s=120)
    records = Registry().checkpoints(unique_run)
    assert [(r.step, r.epoch) for r in records] == [(10, 0), (20, 0)]
    assert all(r.validation_status == "VALIDATED" for r in records)


def test_example_runs_as_is(service, unique_run, monkeypatch, capsys):
    # In this process, with the session's Ray and service (a subprocess would start its own).
    example = ROOT / "examples" / "lightning_trainer.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--run", unique_run])
    runpy.run_path(str(example), run_name="__main__")
    stdout = capsys.readouterr().out
    registry = Registry()
    records = registry.checkpoints(unique_run)
    assert [r.epoch for r in records] == [0, 1, 2, 3]
    assert [r.validation_status for r in records] == ["VALIDATED"] * 4
    for record in records:
        assert (
            f"checkpoint {record.report_index}: val_acc {record.metrics['val_acc']:.4f}" in stdout
        )
    best = registry.best_checkpoint_records(unique_run, "val_acc", "max", k=1)[0]
    assert f"best checkpoint: epoch {best.epoch}, val_acc {best.metrics['val_acc']:.4f}" in stdout


def constant_val_acc(checkpoint, config):
    return {"val_acc": 0.5}  # never improves after the first: patience decides


class SlowEpochs(pl.Callback):
    """Each epoch takes a little time, as real ones do, so validations keep up."""

    def on_train_epoch_end(self, trainer, pl_module):
        time.sleep(0.3)


def test_the_run_stop_policy_sets_trainer_should_stop(service, unique_run):
    """The registry's decision (patience 1: decided on checkpoint 1) stops fit() through
    trainer.should_stop, some epochs later (validation is asynchronous)."""
    from validation_service import StopPolicy

    registry = Registry()
    registry.set_stop_policy(unique_run, StopPolicy("val_acc", patience=1))
    callback = ReportCheckpointCallback(validate_fn=constant_val_acc, run=unique_run)
    trainer = pl.Trainer(
        max_epochs=30,
        accelerator="cpu",
        callbacks=[SlowEpochs(), callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=2,
    )
    trainer.fit(DigitsModule(), digits_loader())
    decision = registry.stop_decision(unique_run)
    assert (decision.rule, decision.report_index) == ("patience", 1)
    assert trainer.should_stop
    epochs_run = trainer.current_epoch
    # not before the deciding checkpoint; within 8 s of 0.3 s epochs after it
    assert 2 <= epochs_run <= 2 + 27, epochs_run
    assert epochs_run < 30
    callback.wait(timeout_s=120)
    assert len(registry.checkpoints(unique_run)) == epochs_run
