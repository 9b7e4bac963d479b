"""A small Ray Tune search over a Ray Train run per trial, validated by ckval: Ray's
documented Train V2 + Tune pattern with ckval's TuneReportCallback (shared by the tests
and the benchmark).

The model is a logistic regression on two Gaussian blobs made here (seeded). It starts
with a bias of 3, so it predicts one class (accuracy 0.5) until it learns: a learning
rate of 0 or 1e-4 stays at chance, 0.5 or 1.0 reaches ~0.95 in its first epoch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import cloudpickle
import ray.cloudpickle
import ray.train
import ray.tune

# Ray workers and the service cannot import this module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GOOD_LRS = (0.5, 1.0)
POOR_LRS = (0.0, 1e-4)


def blobs(seed: int, n: int = 256):
    import torch

    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    centers = labels.float().unsqueeze(1) * 2.0 - 1.0  # -1 or +1 on both features
    features = centers + 0.6 * torch.randn(n, 2, generator=generator)
    return features, labels


def accuracy(weights, features, labels) -> float:

    logits = features @ weights["w"] + weights["b"]
    return float(((logits > 0).long() == labels).float().mean())


def validate_accuracy(checkpoint, config) -> dict:
    """The validate_fn: the checkpoint's accuracy on held-out blobs, taking ``cost_s``."""
    import torch

    started = time.monotonic()
    with checkpoint.as_directory() as directory:
        weights = torch.load(os.path.join(directory, "model.pt"))
    features, labels = blobs(seed=1)
    result = {"val_acc": accuracy(weights, features, labels)}
    time.sleep(max(0.0, config.get("cost_s", 0.5) - (time.monotonic() - started)))
    return result


def train_per_worker(config: dict) -> None:
    """One Ray Train worker: an epoch of ``epoch_s``, a checkpoint validated by ckval."""
    import torch

    from trainer_integration import report

    features, labels = blobs(seed=0)
    weights = {"w": torch.zeros(2, requires_grad=True), "b": torch.full((1,), 3.0)}
    weights["b"].requires_grad_(True)
    optimizer = torch.optim.SGD(list(weights.values()), lr=config["lr"])
    for epoch in range(config["epochs"]):
        started = time.monotonic()
        for _ in range(32):
            optimizer.zero_grad()
            logits = features @ weights["w"] + weights["b"]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
            loss.backward()
            optimizer.step()
        time.sleep(max(0.0, config["epoch_s"] - (time.monotonic() - started)))
        with tempfile.TemporaryDirectory() as directory:
            torch.save({k: v.detach() for k, v in weights.items()}, f"{directory}/model.pt")
            report(
                {"epoch": epoch, "loss": float(loss)},
                checkpoint=ray.train.Checkpoint.from_directory(directory),
                validate_fn=validate_accuracy,
                validate_config={"cost_s": config["validation_s"]},
                validation_resources={"num_cpus": 0.25},
            )


def train_inline_per_worker(config: dict) -> None:
    """The same training validating inline, Ray's only way for Tune to see the metric:
    each epoch waits for its validation, then reports it with ray.train.report."""
    import torch

    features, labels = blobs(seed=0)
    weights = {"w": torch.zeros(2, requires_grad=True), "b": torch.full((1,), 3.0)}
    weights["b"].requires_grad_(True)
    optimizer = torch.optim.SGD(list(weights.values()), lr=config["lr"])
    held_out = blobs(seed=1)
    for epoch in range(config["epochs"]):
        started = time.monotonic()
        for _ in range(32):
            optimizer.zero_grad()
            logits = features @ weights["w"] + weights["b"]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
            loss.backward()
            optimizer.step()
        time.sleep(max(0.0, config["epoch_s"] - (time.monotonic() - started)))
        started = time.monotonic()
        val_acc = accuracy({k: v.detach() for k, v in weights.items()}, *held_out)
        time.sleep(max(0.0, config["validation_s"] - (time.monotonic() - started)))
        ray.train.report({"epoch": epoch, "loss": float(loss), "val_acc": val_acc})


def train_driver(config: dict) -> None:
    """One Tune trial, as Ray's guide writes it, with ckval's TuneReportCallback (or, with
    ``inline``, Ray's own callback and a validation inside the training loop)."""
    from ray.train.torch import TorchTrainer

    if config.get("inline"):
        from ray.tune.integration.ray_train import TuneReportCallback

        per_worker = train_inline_per_worker
    else:
        from trainer_integration.tune import TuneReportCallback

        per_worker = train_per_worker
    TorchTrainer(
        per_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(
            name=f"train-trial_id={ray.tune.get_context().get_trial_id()}",
            storage_path=config["storage_path"],
            callbacks=[TuneReportCallback()],
        ),
    ).fit()


def run_search(
    scheduler,
    *,
    name: str,
    storage_path: str,
    lrs,
    epochs: int,
    callbacks=(),
    max_concurrent_trials: int | None = None,
    **timing,
):
    """Runs the search; returns Tune's ResultGrid. ``timing``: ``epoch_s``,
    ``validation_s``, and ``inline`` (validate in the training loop instead). With
    ``max_concurrent_trials=1`` the trials run one after another, in the order of ``lrs``."""
    config = {
        "inline": timing.get("inline", False),
        "lr": ray.tune.grid_search(list(lrs)),
        "epochs": epochs,
        "epoch_s": timing.get("epoch_s", 2.0),
        "validation_s": timing.get("validation_s", 0.5),
        "storage_path": storage_path,
    }
    tuner = ray.tune.Tuner(
        train_driver,
        param_space=config,
        tune_config=ray.tune.TuneConfig(
            scheduler=scheduler, max_concurrent_trials=max_concurrent_trials
        ),
        run_config=ray.tune.RunConfig(
            name=name, storage_path=storage_path, verbose=0, callbacks=list(callbacks)
        ),
    )
    return tuner.fit()
