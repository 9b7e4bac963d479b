"""PyTorch DDP on a Dask cluster: every epoch's checkpoint validated by ckval, the best queried.

    python examples/dask_ddp.py [--epochs 3] [--run dask-example] [--workers 2]

Starts a local Dask cluster (pass --scheduler tcp://host:8786 to use yours) and the
ckval service on a local Ray. The Dask workers need no Ray: they write checkpoints to
ckval's storage and register them in its database, and the service validates them.
"""

import argparse
import contextlib
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from distributed import Client, LocalCluster
from ray.train import Checkpoint
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import trainer_integration
from trainer_integration.dask import run
from validation_service import Registry, ValidationService


def load_split():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def validate_fn(checkpoint: Checkpoint, config: dict) -> dict:
    """Runs later, on the ckval service: accuracy on the held-out split."""
    _, x_val, _, y_val = load_split()
    model = build_model()
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return {"accuracy": float((predicted == y_val).mean())}


def train(epochs: int, lr: float) -> float:
    """One DDP rank: run() has set up the process group and the ckval run."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, _, y_train, _ = load_split()
    x, y = torch.from_numpy(x_train[rank::world]), torch.from_numpy(y_train[rank::world])
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        for start in range(0, len(x), 32):
            loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = {"epoch": epoch, "loss": loss.item()}
        if rank == 0:
            with tempfile.TemporaryDirectory() as directory:
                torch.save(model.module.state_dict(), os.path.join(directory, "model.pt"))
                trainer_integration.report(
                    metrics, Checkpoint.from_directory(directory), validate_fn=validate_fn
                )
        else:
            trainer_integration.report(metrics, None)
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--run", default="dask-example")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scheduler", default=None, help="address of a running Dask scheduler")
    args = parser.parse_args()
    ValidationService.start()  # on a local Ray; CKVAL_RAY_ADDRESS names a cluster instead
    with contextlib.ExitStack() as stack:
        if args.scheduler:
            client = stack.enter_context(Client(args.scheduler))
        else:
            cluster = stack.enter_context(
                LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True)
            )
            client = stack.enter_context(Client(cluster))
        futures = run(client, train, run_name=args.run, epochs=args.epochs, lr=0.01)
        losses = client.gather(futures)
    print(f"final training loss per rank: {', '.join(f'{loss:.4f}' for loss in losses)}")
    registry = Registry()
    registry.wait(args.run, timeout_s=300)
    for best, metrics in registry.best_checkpoints(args.run, "accuracy", mode="max", k=3):
        print(f"epoch {metrics['epoch']} accuracy {metrics['accuracy']:.4f} at {best.path}")


if __name__ == "__main__":
    main()
