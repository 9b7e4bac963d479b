"""Ray Train + ckval: validate every epoch's checkpoint elsewhere, keep training, query the best.

    python examples/ray_train_torch.py [--epochs 4] [--run my-run]

Written the way Ray's docs write a TorchTrainer program; the only change is that
report() comes from trainer_integration and takes a validate_fn.
"""

import argparse
import logging
import os
import tempfile

import numpy as np
import ray.train
import ray.train.torch
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from trainer_integration import ray_results_path, report
from validation_service import Registry


def load_split():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def build_model():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def validate_fn(checkpoint: Checkpoint, config: dict) -> dict:
    """Runs later, in a separate Ray task: accuracy on the held-out split."""
    import torchmetrics

    _, x_val, _, y_val = load_split()
    model = build_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    model.eval()
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    with torch.no_grad():
        accuracy.update(model(torch.from_numpy(x_val)), torch.from_numpy(y_val))
    return {"accuracy": accuracy.compute().item()}


def train_func(config):
    x_train, _, y_train, _ = load_split()
    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    x, y = torch.from_numpy(x_train[rank::world]), torch.from_numpy(y_train[rank::world])
    model = ray.train.torch.prepare_model(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
            loss.backward()
            optimizer.step()
        metrics = {"epoch": epoch, "loss": loss.item()}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            if ray.train.get_context().get_world_rank() == 0:
                torch.save(model.module.state_dict(), os.path.join(temp_checkpoint_dir, "model.pt"))
                report(
                    metrics,
                    checkpoint=Checkpoint.from_directory(temp_checkpoint_dir),
                    validate_fn=validate_fn,
                    validate_config={},
                    validation_resources={"num_cpus": 1},
                )
            else:
                report(metrics, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--run", default="digits-example")
    args = parser.parse_args()
    # On a laptop: a local Ray with room for 2 training workers and 2 validations. Quiet:
    # the driver logs Ray's warnings only, and the workers' and actors' output stays in
    # Ray's log files (/tmp/ray/session_latest/logs) instead of this terminal; set
    # log_to_driver=True to see what train_func prints.
    ray.init(
        num_cpus=max(4, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    train_logging = getattr(ray.train, "LoggingConfig", None)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.01, "epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=args.run,
            # Ray Train's results next to ckval's, under CKVAL_HOME (not ~/ray_results).
            storage_path=ray_results_path(),
            # Ray Train logs each report and worker start at INFO: warnings only.
            # ray.train.LoggingConfig: Ray 2.56+ (earlier releases log at their default)
            **({"logging_config": train_logging(log_level="WARNING")} if train_logging else {}),
        ),
    )
    result = trainer.fit()
    print(f"training done: {len(result.best_checkpoints)} checkpoints in Ray's Result")

    registry = Registry()
    # A live line of the validations' progress; a warning names any that failed.
    registry.wait(args.run, timeout_s=300, progress=True)
    for checkpoint, metrics in registry.best_checkpoints(args.run, "accuracy", "max", k=3):
        print(f"epoch {metrics['epoch']}: accuracy {metrics['accuracy']:.4f}  {checkpoint.path}")


if __name__ == "__main__":
    main()
