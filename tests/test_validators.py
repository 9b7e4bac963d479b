"""Real Ray: MapBatchesValidator, TorchTrainerValidator and Ray-guide validate_fns on digits."""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle
import ray.data
import ray.train
import ray.train.torch
import torch
import torchmetrics
from ray.data.aggregate import Count, Max, Mean, Sum
from ray.train import Checkpoint, RunConfig, ScalingConfig

from trainer_integration import Client
from validation_service import _ray_compat
from validation_service.cli.demo import load_digits_split, make_model
from validation_service.errors import InvalidInput, PermanentValidationError
from validation_service.executors.map_batches import MapBatchesValidator
from validation_service.executors.torch_trainer import (
    TorchTrainerValidator,
    validation_run_name,
)
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module: ship its functions and classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WAIT_S = 240
# The held-out digits, as in-memory rows (the training run's validation set).
_, X_VAL, _, Y_VAL = load_digits_split()
# Set by the `guide_dataset` fixture; the guide-style validate_fns capture it, as in Ray's guide.
validation_dataset = None


def load_model(checkpoint: Checkpoint) -> torch.nn.Module:
    model = make_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), map_location="cpu"))
    return model.eval()


def direct_metrics(checkpoint_dir: str, count: int | None = None) -> dict[str, float]:
    """Accuracy (numpy argmax of the logits against the labels) and mean loss, in-process."""
    x, y = X_VAL[:count], Y_VAL[:count]
    model = load_model(Checkpoint.from_directory(checkpoint_dir))
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        losses = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="none")
    correct = np.argmax(logits.numpy(), axis=1) == y
    return {
        "accuracy": float(np.mean(correct)),
        "num_correct": int(correct.sum()),
        "loss": float(losses.double().mean()),
        "max_loss": float(losses.max()),
        "rows": len(y),
    }


def digits_rows(count: int | None = None) -> list[dict]:
    return [{"x": x, "y": int(y)} for x, y in zip(X_VAL[:count], Y_VAL[:count], strict=True)]


def digits_dataset() -> ray.data.Dataset:
    """A zero-argument dataset source: built where the validation runs."""
    return ray.data.from_items(digits_rows(), override_num_blocks=4)


def attach_digits(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"x": X_VAL[batch["id"]], "y": Y_VAL[batch["id"]]}


def lazy_digits_dataset() -> ray.data.Dataset:
    """A lazy Dataset (a plan, no blocks yet): it pickles as is and is read where it runs."""
    return ray.data.range(len(Y_VAL), override_num_blocks=3).map_batches(attach_digits)


class DigitsPredictor:
    """A map_batches predictor: one 0/1 "correct" and one "loss" per row."""

    def __init__(self, checkpoint: Checkpoint):
        self.model = load_model(checkpoint)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        labels = torch.as_tensor(batch["y"])
        with torch.no_grad():
            logits = self.model(torch.as_tensor(batch["x"], dtype=torch.float32))
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        return {
            "correct": (logits.argmax(dim=1) == labels).numpy().astype(np.int64),
            "loss": loss.numpy(),
        }


def digits_eval_loop(config: dict) -> None:
    """An eval-only Ray Train loop: metrics synced across workers by torchmetrics."""
    model = load_model(config["checkpoint"])
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    mean_loss = torchmetrics.MeanMetric()
    rows = torchmetrics.SumMetric()
    shard = ray.train.get_dataset_shard("validation")
    with torch.no_grad():
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
            logits = model(batch["x"].float())
            accuracy.update(logits, batch["y"])
            mean_loss.update(
                torch.nn.functional.cross_entropy(logits, batch["y"], reduction="none")
            )
            rows.update(len(batch["y"]))
    ray.train.report(
        {
            "accuracy": accuracy.compute().item(),
            "loss": mean_loss.compute().item(),
            "rows": rows.compute().item(),
        }
    )


def digits_eval_loop_returning(config: dict) -> dict:
    """Reports the row count and returns the accuracy (Ray's guide returns its metrics):
    the validator merges what rank 0 returned into what it reported last."""
    model = load_model(config["checkpoint"])
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    rows = torchmetrics.SumMetric()
    shard = ray.train.get_dataset_shard("validation")
    with torch.no_grad():
        for batch in shard.iter_torch_batches(batch_size=64):
            accuracy.update(model(batch["x"].float()), batch["y"])
            rows.update(len(batch["y"]))
    ray.train.report({"rows": rows.compute().item()})
    return {"accuracy": accuracy.compute().item()}


# ------------------------------------------------- validate_fns written as in Ray's guide


class Predictor:
    def __init__(self, checkpoint: ray.train.Checkpoint):
        self.model = make_model()
        with checkpoint.as_directory() as checkpoint_dir:
            model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
            self.model.load_state_dict(model_state_dict)
        self.model.eval()

    def __call__(self, batch: dict) -> dict:
        image = torch.as_tensor(batch["x"], dtype=torch.float32)
        label = torch.as_tensor(batch["y"])
        with torch.no_grad():
            pred = self.model(image)
        return {"res": (pred.argmax(1) == label).numpy()}


def validate_with_map_batches(checkpoint: ray.train.Checkpoint, config: dict) -> dict:
    # Set name to avoid confusion; default name is "Dataset"
    validation_dataset.set_name("validation")
    eval_res = validation_dataset.map_batches(
        Predictor,
        batch_size=128,
        fn_constructor_kwargs={"checkpoint": checkpoint},
        concurrency=2,
    )
    mean = eval_res.mean("res")
    return {"accuracy": mean}


def eval_only_train_fn(config_dict: dict) -> dict:
    model = make_model()
    with config_dict["checkpoint"].as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model.load_state_dict(model_state_dict)
    model.eval()

    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    test_data_shard = ray.train.get_dataset_shard("validation")
    test_dataloader = test_data_shard.iter_torch_batches(batch_size=128)

    # Compute metric and return it directly from the train function
    with torch.no_grad():
        for batch in test_dataloader:
            outputs = model(batch["x"].float())
            accuracy(outputs, batch["y"])
    return {"accuracy": accuracy.compute().item()}


def validate_with_torch_trainer(checkpoint: ray.train.Checkpoint, config: dict) -> dict:
    trainer = ray.train.torch.TorchTrainer(
        eval_only_train_fn,
        train_loop_config={"checkpoint": checkpoint},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        # Name validation run to easily associate it with training run
        run_config=ray.train.RunConfig(
            name=f"{config['train_run_name']}_validation_epoch_{config['epoch']}",
            storage_path=config["storage_path"],
        ),
        datasets={"validation": validation_dataset},
    )
    result = trainer.fit()
    # return_value holds the return value of the train function from worker 0
    return result.return_value


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory) -> list[str]:
    """Two checkpoints of a digits model trained in-process: after 1 and after 4 epochs."""
    x_train, _, y_train, _ = load_digits_split()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train).long()
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dirs = []
    for epoch in range(4):
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[start : start + 64]), y[start : start + 64]
            )
            loss.backward()
            optimizer.step()
        if epoch in (0, 3):
            directory = tmp_path_factory.mktemp(f"digits-epoch{epoch}")
            torch.save(model.state_dict(), directory / "model.pt")
            dirs.append(str(directory))
    accuracies = [direct_metrics(d)["accuracy"] for d in dirs]
    assert 0.1 < accuracies[0] < accuracies[1], accuracies  # two distinguishable models
    return dirs


@pytest.fixture
def guide_dataset(ray_session):
    global validation_dataset
    validation_dataset = lazy_digits_dataset()
    yield validation_dataset
    validation_dataset = None


def report_and_wait(
    run: str, checkpoint_dirs: list[str], validate_fn, config_for=None, **kwargs
) -> list:
    """Reports each checkpoint with validate_fn, waits for the service, returns the records."""
    client = Client(run)
    for epoch, directory in enumerate(checkpoint_dirs):
        client.report(
            {"epoch": epoch},
            Checkpoint.from_directory(directory),
            validate_fn=validate_fn,
            validate_config=config_for(epoch) if config_for else None,
            max_attempts=1,
            **kwargs,
        )
    registry = Registry()
    registry.wait(run, timeout_s=WAIT_S)
    jobs = registry.validations(run)
    assert [job.status for job in jobs] == ["SUCCEEDED"] * len(checkpoint_dirs), [
        (job.status, job.error_message) for job in jobs
    ]
    records = registry.checkpoints(run)
    assert [r.validation_status for r in records] == ["VALIDATED"] * len(checkpoint_dirs)
    return records


def assert_accuracy_is_direct(records) -> None:
    """The registry holds, for each checkpoint, the accuracy computed here from its files."""
    for record in records:
        expected = direct_metrics(record.uri)["accuracy"]
        assert record.validated_metrics["accuracy"] == pytest.approx(expected, abs=1e-6)
        assert record.metrics["accuracy"] == record.validated_metrics["accuracy"]


# ------------------------------------------------------------------------------- tests


def test_validators_refuse_unusable_arguments_before_running(tmp_path):
    with pytest.raises(InvalidInput, match="callable class"):
        MapBatchesValidator(attach_digits, digits_dataset)
    with pytest.raises(InvalidInput, match="ray.data.Dataset or a zero-argument function"):
        MapBatchesValidator(DigitsPredictor, digits_rows())
    with pytest.raises(InvalidInput, match="concurrency"):
        MapBatchesValidator(DigitsPredictor, digits_dataset, concurrency=0)
    with pytest.raises(InvalidInput, match="distinct names"):
        MapBatchesValidator(
            DigitsPredictor, digits_dataset, aggregate={"a": Mean("loss"), "b": Mean("loss")}
        )
    with pytest.raises(InvalidInput, match="'checkpoint' key"):
        TorchTrainerValidator(
            digits_eval_loop,
            scaling_config=ScalingConfig(num_workers=2),
            eval_config={"checkpoint": "elsewhere"},
        )
    # validate_config entries go to the predictor's constructor: a key it lacks fails at once.
    with pytest.raises(PermanentValidationError, match="batch_size"):
        MapBatchesValidator(DigitsPredictor, digits_dataset)(
            Checkpoint.from_directory(str(tmp_path)), {"batch_size": 256}
        )
    on_a10g = TorchTrainerValidator(
        digits_eval_loop,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="A10G"),
    )
    assert on_a10g.recommended_resources == {"num_cpus": 0, "accelerator_type": "A10G"}


def test_validation_run_name_follows_the_checkpoint_storage_layout(tmp_path):
    stored = tmp_path / "digits-run" / "checkpoint_000003"
    stored.mkdir(parents=True)
    assert validation_run_name(Checkpoint.from_directory(str(stored))) == "digits-run-validate-3"
    downloaded = Checkpoint.from_directory(str(tmp_path))
    first, second = validation_run_name(downloaded), validation_run_name(downloaded)
    assert first.startswith(f"ckval-validate-{tmp_path.name}-") and first != second


def test_map_batches_validator_matches_direct_metrics(ray_session, checkpoint_dirs):
    validator = MapBatchesValidator(DigitsPredictor, lazy_digits_dataset(), batch_size=64)
    metrics = validator(Checkpoint.from_directory(checkpoint_dirs[1]), {})
    expected = direct_metrics(checkpoint_dirs[1])
    assert set(metrics) == {"accuracy", "loss"}
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)


def test_map_batches_validator_with_ray_data_aggregations(ray_session, checkpoint_dirs):
    validator = MapBatchesValidator(
        DigitsPredictor,
        digits_dataset,
        batch_size=100,
        aggregate={
            "accuracy": Mean("correct"),
            "num_correct": Sum("correct"),
            "rows": Count(),
            "max_loss": Max("loss"),
        },
    )
    metrics = validator(Checkpoint.from_directory(checkpoint_dirs[0]), {})
    expected = direct_metrics(checkpoint_dirs[0])
    assert set(metrics) == {"accuracy", "num_correct", "rows", "max_loss"}
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert (metrics["num_correct"], metrics["rows"]) == (expected["num_correct"], len(Y_VAL))
    assert metrics["max_loss"] == pytest.approx(expected["max_loss"], rel=1e-5)


def test_torch_trainer_validator_merges_what_the_eval_loop_returns_on_rank_0(
    ray_session, checkpoint_dirs, session_home
):
    """Through Result.return_value (Ray 2.56+) or the file the loop writes (2.51-2.55)."""
    rows = len(Y_VAL)
    validator = TorchTrainerValidator(
        digits_eval_loop_returning,
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"validation": ray.data.from_items(digits_rows(rows), override_num_blocks=2)},
        run_config=RunConfig(storage_path=str(session_home / "ray_results")),
    )
    metrics = validator(Checkpoint.from_directory(checkpoint_dirs[1]), {})
    expected = direct_metrics(checkpoint_dirs[1], rows)
    assert metrics["rows"] == rows
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)


def test_map_batches_validator_through_report(service, checkpoint_dirs, unique_run):
    # An in-memory Dataset: a copy of its rows travels inside the stored validate_fn.
    validator = MapBatchesValidator(
        DigitsPredictor, ray.data.from_items(digits_rows(), override_num_blocks=3)
    )
    assert validator.recommended_resources == {"num_cpus": 0}
    records = report_and_wait(
        unique_run,
        checkpoint_dirs,
        validator,
        validation_resources=validator.recommended_resources,
    )
    assert_accuracy_is_direct(records)
    assert records[0].metrics["accuracy"] < records[1].metrics["accuracy"]
    for record in records:
        expected = direct_metrics(record.uri)["loss"]
        assert record.validated_metrics["loss"] == pytest.approx(expected, abs=1e-5)


def digits_dataset_but_one() -> ray.data.Dataset:
    """449 rows in 3 blocks: over 2 workers, Ray Train's default split would drop one."""
    return ray.data.from_items(digits_rows(len(Y_VAL) - 1), override_num_blocks=3)


def test_torch_trainer_validator_through_report_on_every_row(
    service, checkpoint_dirs, unique_run, session_home
):
    validator = TorchTrainerValidator(
        digits_eval_loop,
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"validation": digits_dataset_but_one},
        eval_config={"batch_size": 64},
    )
    assert validator.recommended_resources == {"num_cpus": 0}
    # One checkpoint: each eval-only run costs about a minute of CPU on 2 cores.
    (record,) = report_and_wait(
        unique_run,
        checkpoint_dirs[:1],
        validator,
        validation_resources=validator.recommended_resources,
    )
    rows = len(Y_VAL) - 1
    expected = direct_metrics(record.uri, rows)
    assert record.validated_metrics["rows"] == rows
    assert record.validated_metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert record.metrics["accuracy"] == record.validated_metrics["accuracy"]
    assert record.validated_metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    # The eval-only run is named after the training run and the report index.
    assert f"{unique_run}-validate-0" in os.listdir(session_home / "ray_results")


def test_guide_style_map_batches_validate_fn_through_report(
    service, checkpoint_dirs, unique_run, guide_dataset
):
    records = report_and_wait(
        unique_run,
        checkpoint_dirs[1:],
        validate_with_map_batches,
        validation_resources={"num_cpus": 0},
    )
    assert_accuracy_is_direct(records)


@pytest.mark.skipif(
    not _ray_compat.result_has_return_value(),
    reason="Ray's guide reads ray.train.Result.return_value, which Ray 2.51-2.55 lack",
)
def test_guide_style_torch_trainer_validate_fn_through_report(
    service, checkpoint_dirs, unique_run, guide_dataset, session_home
):
    def config_for(epoch: int) -> dict:
        storage_path = str(session_home / "ray_results")
        return {"train_run_name": unique_run, "epoch": epoch, "storage_path": storage_path}

    records = report_and_wait(
        unique_run,
        checkpoint_dirs[1:],
        validate_with_torch_trainer,
        config_for=config_for,
        validation_resources={"num_cpus": 0},
    )
    assert_accuracy_is_direct(records)
    assert f"{unique_run}_validation_epoch_0" in os.listdir(session_home / "ray_results")
