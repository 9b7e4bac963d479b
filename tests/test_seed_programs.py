"""The seed programs, run as written with ckval (tests/seed_programs/): Ray Train's
PyTorch and async-validation guides, and dask-pytorch-ddp's README program.

The Keras guide's quickstart is run by tests/test_keras.py (ckval's callback in a
2-worker TensorflowTrainer).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pickle
import re
import runpy
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle
import torch

from tests.moto_s3 import environment, moto_s3_server, png_bytes
from tests.seed_programs import _torchvision_standin, _validation
from tests.seed_programs._torchvision_standin import Compose, FashionMNIST, Normalize, ToTensor
from trainer_integration import Client
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray
SEEDS = Path(__file__).resolve().parent / "seed_programs"

# Ray workers and the service cannot import the tests package: ship these by value.
for _module in (_torchvision_standin, _validation):
    cloudpickle.register_pickle_by_value(_module)
    ray.cloudpickle.register_pickle_by_value(_module)


def held_out_by_hand(checkpoint_dir: str) -> dict[str, float]:
    """Accuracy and mean loss of a stored model.pt, one image at a time."""
    model = _validation.guide_model()
    model.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt")))
    model.eval()
    transform = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])
    losses, correct = [], []
    with torch.no_grad():
        for image, label in FashionMNIST(root="", train=False, transform=transform):
            logits = model(image.unsqueeze(0))
            losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor([label])).item())
            correct.append(int(logits.argmax(dim=1).item() == label))
    return {"accuracy": float(np.mean(correct)), "val_loss": float(np.mean(losses))}


def test_ray_train_pytorch_guide(service, session_home, monkeypatch):
    import ray.train.constants

    # The guide sets no storage_path: Ray's default (~/ray_results) goes under the session.
    monkeypatch.setattr(
        ray.train.constants, "DEFAULT_STORAGE_PATH", str(session_home / "ray_results")
    )
    program = runpy.run_path(str(SEEDS / "ray_train_pytorch_guide.py"), run_name="__main__")
    result = program["result"]
    assert result.error is None
    run = os.path.basename(result.path)  # Ray's default name, ray_train_run-<date>_<time>
    registry = Registry()
    registry.wait(run, timeout_s=180)
    records = registry.checkpoints(run)
    # Both ranks reported a checkpoint each epoch, as in the guide: rank 0's was stored.
    assert [r.epoch for r in records] == list(range(10))
    assert [r.validation_status for r in records] == ["VALIDATED"] * 10
    for record in records:
        expected = held_out_by_hand(record.uri)
        assert record.metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)
        assert record.metrics["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-5)
    # Step [6] loaded the last reported model.
    stored = torch.load(os.path.join(records[-1].uri, "model.pt"))
    for name, value in program["model"].state_dict().items():
        assert torch.equal(value, stored[name])


def test_ray_async_validation_guide(service, session_home, unique_run):
    from ray.train import RunConfig

    # Imported here: the module builds its validation Dataset, which needs Ray running.
    guide = importlib.import_module("tests.seed_programs.ray_async_validation_guide")
    cloudpickle.register_pickle_by_value(guide)
    ray.cloudpickle.register_pickle_by_value(guide)
    result = guide.run_trainer(
        epochs=1,
        run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
    )
    assert result.error is None
    registry = Registry()
    [record] = registry.checkpoints(unique_run)
    # The guide's first validation_fn, on the same stored checkpoint, while the one the
    # program reported with (an eval-only TorchTrainer run) goes on.
    variants = f"{unique_run}-simple"
    with Client(variants) as client:
        client.report(
            {"epoch": 0},
            ray.train.Checkpoint.from_directory(record.uri),
            validate_fn=guide.validation_fn_simple,
            validation_resources={"num_cpus": 0},
        )
    registry.wait(unique_run, timeout_s=300)
    registry.wait(variants, timeout_s=180)

    [record] = registry.checkpoints(unique_run)
    assert record.validation_status == "VALIDATED"
    expected = held_out_by_hand(record.uri)
    # validation_fn(checkpoint, train_run_name, epoch): an eval-only TorchTrainer run
    # named after the training run, its mean loss over the 2 workers' halves.
    assert record.metrics["score"] == pytest.approx(expected["val_loss"], abs=1e-5)
    assert f"{unique_run}_validation_epoch_0" in os.listdir(session_home / "ray_results")
    [simple] = registry.checkpoints(variants)
    assert simple.metrics["score"] == pytest.approx(expected["accuracy"], abs=1e-9)


def readme_accuracy_by_hand(state: dict) -> float:
    """The README model's accuracy with torch.nn.functional on the saved tensors."""
    from PIL import Image

    correct = 0
    for key, colour in _validation.readme_images():
        image = _validation.readme_transform()(Image.new("RGB", (16, 16), colour)).unsqueeze(0)
        hidden = torch.relu(
            torch.nn.functional.conv2d(image, state["module.conv1.weight"], stride=2, padding=3)
        )
        pooled = torch.nn.functional.adaptive_avg_pool2d(hidden, (14, 1)).flatten(1)
        logits = pooled @ state["module.fc.weight"].T + state["module.fc.bias"]
        correct += int(logits.argmax().item() == (0 if key.startswith("dark") else 1))
    return correct / len(_validation.readme_images())


def test_dask_pytorch_ddp_readme(service, tmp_path, monkeypatch):
    import dask
    from distributed import Client, LocalCluster

    from trainer_integration.dask import run

    with moto_s3_server("readme") as endpoint:
        # The program names no endpoint: the AWS variables point S3 at moto, here and in
        # the Dask workers started below.
        for name, value in environment(endpoint).items():
            monkeypatch.setenv(name, value)
        import fsspec

        s3 = fsspec.filesystem("s3", skip_instance_cache=True)
        for key, colour in _validation.readme_images():
            s3.pipe(f"readme/images/{key}", png_bytes(colour, (16, 16)))
        # As a script (__main__): its functions travel by value, with the handler rh.
        program = runpy.run_path(str(SEEDS / "dask_pytorch_ddp_readme.py"), run_name="__main__")
        # The README's DataLoader forks: Dask's worker processes must not be daemons.
        with (
            dask.config.set({"distributed.worker.daemon": False}),
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            futures = run(
                client,
                program["run_transfer_learning"],
                run_name=program["key"],
                bucket="readme",
                prefix="images",
                samplesize=20,
                n_epochs=5,  # 100 steps of 20 images: the README's checkpoint at count 100
            )
            program["rh"].process_results(str(tmp_path), futures, raise_errors=True)

    registry = Registry()
    registry.wait(program["key"], timeout_s=180)
    records = registry.checkpoints(program["key"])
    assert [r.validation_status for r in records] == ["VALIDATED"]
    for record in records:
        # checkpoint-<ISO time>.pkl, ":" and all, stored and written under the prefix.
        name = record.metrics["file"]
        stamp = name.removeprefix("checkpoint-").removesuffix(".pkl")
        assert datetime.datetime.fromisoformat(stamp) and ":" in stamp
        assert (tmp_path / name).read_bytes() == (Path(record.uri) / name).read_bytes()
        state = pickle.loads((tmp_path / name).read_bytes())
        assert record.metrics["accuracy"] == readme_accuracy_by_hand(state)
        # The rank-0 statistics submitted just before the checkpoint are its metrics.
        sent = json.loads((tmp_path / "worker" / "0" / f"data-{stamp}.json").read_text())
        assert record.reported_metrics == sent and sent["worker"] == 0
    assert [r.reported_metrics["count"] for r in records] == [100]
    for rank in (0, 1):
        written = list((tmp_path / "worker" / str(rank)).glob("data-*.json"))
        assert len(written) == 100 and all(re.search(r"T\d\d:\d\d:", p.name) for p in written)


def test_validate_fns_in_ckvals_form_and_in_ray_trains_form():
    from validation_service.errors import InvalidInput
    from validation_service.validate_fn import call_validate_fn

    def ckval_form(checkpoint, config):
        return {"config": config}

    def ray_form(checkpoint, train_run_name, epoch):
        return {"name": train_run_name, "epoch": epoch}

    def checkpoint_only(checkpoint):
        return {"alone": True}

    def one_named(checkpoint, epoch=None):
        return {"epoch": epoch}

    config = {"train_run_name": "r", "epoch": 3}
    assert call_validate_fn(ckval_form, "ckpt", config) == {"config": config}
    assert call_validate_fn(ray_form, "ckpt", config) == {"name": "r", "epoch": 3}
    assert call_validate_fn(checkpoint_only, "ckpt", {}) == {"alone": True}
    # Both forms bind: every key names a parameter, so the keyword form, as Ray calls it.
    assert call_validate_fn(one_named, "ckpt", {"epoch": 3}) == {"epoch": 3}
    assert call_validate_fn(ckval_form, "ckpt", {}) == {"config": {}}
    with pytest.raises(InvalidInput, match="takes neither.*keys \\['epoch', 'train_run_name'\\]"):
        call_validate_fn(checkpoint_only, "ckpt", config)


def test_ray_trains_upload_modes_are_taken_and_others_refused():
    import ray.train

    from trainer_integration import CheckpointUploadMode, upload_mode
    from validation_service.errors import InvalidInput

    for mode in CheckpointUploadMode:
        assert upload_mode(getattr(ray.train.CheckpointUploadMode, mode.name)) is mode
        assert upload_mode(mode) is mode
    with pytest.raises(InvalidInput, match="must be a CheckpointUploadMode .*got 'ASYNC'"):
        upload_mode("ASYNC")
