"""`ckval demo`: TorchTrainer on scikit-learn's bundled digits, validated every epoch."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from torch import nn

from validation_service import _ray_compat
from validation_service.errors import (
    PermanentValidationError,
    ValidationsFailedWarning,
    failed_validations_message,
)
from validation_service.jobs import JobStatus

logger = logging.getLogger(__name__)

HIDDEN = 64
SPLIT_SEED = 0


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits (8x8 images, 10 classes) shipped inside scikit-learn: 75% train, 25% held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return train_test_split(
        x, data.target, test_size=0.25, random_state=SPLIT_SEED, stratify=data.target
    )


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def train_func(config: dict[str, Any]) -> None:
    """A Ray Train loop as in Ray's docs, reporting through trainer_integration.report."""
    import ray.train
    import ray.train.torch

    from trainer_integration import report

    torch.manual_seed(config.get("seed", 0))
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x_train, _, y_train, _ = load_digits_split()
    x = torch.from_numpy(x_train[rank::world])
    y = torch.from_numpy(y_train[rank::world]).long()
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batch = config.get("batch_size", 32)
    for epoch in range(config["epochs"]):
        model.train()
        order = torch.randperm(len(x))
        total = 0.0
        for start in range(0, len(x), batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        metrics = {"epoch": epoch, "train_loss": total / len(x)}
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                module = model.module if hasattr(model, "module") else model
                torch.save(module.state_dict(), os.path.join(tmp, "model.pt"))
                report(
                    metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(tmp),
                    validate_fn=validate_digits,
                    validate_config={
                        "batch_size": 256,
                        "fail": epoch in config.get("fail_epochs", ()),
                    },
                    validation_resources={"num_cpus": 1},
                )
            else:
                report(metrics, None)


def validate_digits(checkpoint, config: dict[str, Any]) -> dict[str, float]:
    """Accuracy and loss on the held-out split, computed with torchmetrics."""
    import torchmetrics

    if config.get("fail"):
        raise PermanentValidationError(
            "this epoch's validation was asked to fail (run_demo(fail_epochs=...))"
        )
    _, x_val, _, y_val = load_digits_split()
    model = make_model()
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "model.pt"), map_location="cpu")
    model.load_state_dict(state)
    model.eval()
    # No cross-process sync: the validation sees the whole held-out split, and a sync
    # would wait forever for other ranks if called inside a Ray Train worker.
    accuracy = torchmetrics.classification.MulticlassAccuracy(
        num_classes=10, average="micro", sync_on_compute=False
    )
    mean_loss = torchmetrics.MeanMetric(sync_on_compute=False)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    batch = config.get("batch_size", 256)
    with torch.no_grad():
        for start in range(0, len(x_val), batch):
            xb = torch.from_numpy(x_val[start : start + batch])
            yb = torch.from_numpy(y_val[start : start + batch]).long()
            logits = model(xb)
            accuracy.update(logits, yb)
            mean_loss.update(loss_fn(logits, yb))
    return {"accuracy": accuracy.compute().item(), "val_loss": mean_loss.compute().item()}


def _top_checkpoints(registry, run_name: str) -> str:
    from validation_service.cli._table import render

    best = registry.best_checkpoint_records(run_name, metric="accuracy", mode="max", k=3)
    rows = [
        [
            i + 1,
            r.epoch,
            r.metrics.get("accuracy"),
            r.metrics.get("val_loss"),
            r.metrics.get("train_loss"),
            r.uri,
        ]
        for i, r in enumerate(best)
    ]
    return render(["rank", "epoch", "accuracy", "val_loss", "train_loss", "checkpoint"], rows)


class TrainingProgress:
    """Shows the run's validation counts while training goes on, from a daemon thread.

    Polls the registry (the run exists once its first checkpoint is reported) and hands
    the counts to a ProgressRenderer, which writes only when they change.
    """

    def __init__(self, registry, run_name: str, renderer, poll_s: float = 0.5):
        self.registry = registry
        self.run_name = run_name
        self.renderer = renderer
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="ckval-demo-progress", daemon=True)

    def __enter__(self) -> TrainingProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.renderer.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.registry.find_run_id(self.run_name) is not None:
                    self.renderer.update(self.run_name, self.registry.job_counts(self.run_name))
            except Exception:  # noqa: BLE001 - progress is a courtesy; training goes on
                logger.debug("reading the demo's progress failed", exc_info=True)


def exit_message(registry, run_name: str, epochs: int) -> str | None:
    """Why the demo fails (validations that failed, or too few validated), or None."""
    from validation_service.registry.waiting import failed_jobs

    counts = registry.job_counts(run_name)
    failed = failed_jobs(registry.validations(run_name))
    if failed:
        return failed_validations_message(run_name, failed, sum(counts.values()))
    if counts.get(JobStatus.SUCCEEDED.value, 0) != epochs:
        return f"expected {epochs} validated checkpoints, got {counts}"
    return None


def run_demo(
    epochs: int = 5,
    num_workers: int = 2,
    run_name: str | None = None,
    *,
    fail_epochs: Collection[int] = (),
) -> None:
    """Trains, validates every epoch's checkpoint and prints the best; exits non-zero
    (SystemExit naming the jobs) when a validation failed.

    ``fail_epochs``: epochs whose validation raises on purpose, to see what a failed
    validation looks like.
    """
    from validation_service.config import get_settings
    from validation_service.progress import ProgressRenderer
    from validation_service.registry.registry import Registry
    from validation_service.secrets import mask_url
    from validation_service.service import ValidationService

    settings = get_settings()
    run_name = run_name or f"ckval-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"ckval demo: run {run_name!r}")
    print(f"  registry: {mask_url(settings.resolved_database_url())}")
    print(f"  storage:  {mask_url(settings.resolved_storage())}")
    _start_ray(num_workers)
    service = ValidationService.start(settings=settings)
    registry = Registry(settings=settings)
    renderer = ProgressRenderer(sys.stdout)
    started = time.perf_counter()
    trainer = _trainer(settings, run_name, epochs, num_workers, fail_epochs)
    print(f"training {epochs} epochs on {num_workers} workers, validating every epoch...")
    with TrainingProgress(registry, run_name, renderer):
        result = trainer.fit()
    trained = time.perf_counter() - started
    print(
        f"training finished in {trained:.1f}s with {len(result.best_checkpoints)} "
        "checkpoints in Ray's Result; waiting for validations..."
    )
    with warnings.catch_warnings():
        # exit_message() below says which validations failed, and the demo exits non-zero.
        warnings.simplefilter("ignore", ValidationsFailedWarning)
        registry.wait(run_name, timeout_s=300, progress=renderer)
    waited = time.perf_counter() - started - trained
    print(f"all validations done {waited:.1f}s after training ended\n")
    _print_outcome(registry, service, run_name)
    message = exit_message(registry, run_name, epochs)
    if message is not None:
        raise SystemExit(f"ckval demo failed: {message}")


def _start_ray(num_workers: int) -> None:
    """A local Ray for the demo, unless one is already initialised."""
    import ray

    from validation_service.secrets import ckval_env

    if ray.is_initialized():
        return
    # Logical CPUs for the training workers plus concurrent validations, on any machine.
    # Ray's own output stays out of the demo's: workers' and actors' lines are not
    # forwarded, and the driver logs warnings only.
    ray.init(
        num_cpus=max(os.cpu_count() or 1, num_workers + 2),
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": ckval_env()},
    )


def _trainer(settings, run_name: str, epochs: int, num_workers: int, fail_epochs):
    """The demo's TorchTrainer: ``train_func`` on ``num_workers`` workers."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainer_integration.run_status import RunStatusCallback

    return TorchTrainer(
        train_func,
        train_loop_config={
            "epochs": epochs,
            "lr": 0.1,
            "batch_size": 32,
            "fail_epochs": sorted(fail_epochs),
        },
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(settings.resolved_home() / "ray_results"),
            **_ray_compat.logging_config_kwargs("WARNING"),  # Ray 2.56+ only
            # The ckval run ends FINISHED (or FAILED) with the Ray Train run.
            callbacks=[RunStatusCallback(settings)],
        ),
    )


def _print_outcome(registry, service, run_name: str) -> None:
    print("top-3 checkpoints by validated accuracy:")
    print(_top_checkpoints(registry, run_name))
    counts = registry.job_counts(run_name)
    print(f"\nvalidation jobs: {counts}")
    print(f"try: ckval best {run_name} --metric accuracy -k 3")
    status = service.status()
    print(f"service {status['owner']}: {status['finished']} validations finished")
