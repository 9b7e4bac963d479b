"""FSDP2 + ckval: 2 ranks train a sharded model, each saves its own shard, and an eval-only
TorchTrainer of 3 ranks validates every checkpoint, resharded as it loads.

    python examples/sharded_fsdp2.py [--reports 2] [--run fsdp2-example]

Written the way Ray Train's FSDP guide writes it: every rank calls dcp.save() into a folder
of its own and report() with that folder; ckval stores the ranks' folders as one checkpoint.
On CPU (gloo) here; on GPUs, init_device_mesh("cuda", ...) and ScalingConfig(use_gpu=True).
"""

import argparse
import logging
import os
import tempfile

import numpy as np
import ray.data
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer_integration import ray_results_path, report
from validation_service import Registry
from validation_service.validators.dcp import in_lockstep, load_sharded
from validation_service.validators.torch_trainer import TorchTrainerValidator

FEATURES, CLASSES = 8, 4


def make_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by the largest of their first 4 coordinates."""
    x = np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)
    return x, x[:, :CLASSES].argmax(axis=1)


def build_sharded_model() -> nn.Module:
    """An MLP sharded with FSDP2 across every rank of this world (each layer, then the root)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def validation_dataset() -> ray.data.Dataset:
    x, y = make_data(500, seed=1)
    return ray.data.from_items(
        [{"x": row, "y": int(label)} for row, label in zip(x, y, strict=True)]
    )


def eval_loop(config: dict) -> dict:
    """Each eval rank holds 1/M of the model and scores 1/M of the rows."""
    model = load_sharded(build_sharded_model(), config["checkpoint"]).eval()
    totals = torch.zeros(3, dtype=torch.float64)  # summed loss, correct rows, rows
    batches = ray.train.get_dataset_shard("validation").iter_torch_batches(batch_size=64)
    # Every forward pass of a sharded model is collective: ranks with fewer rows run
    # empty batches until all are done.
    empty = {"x": torch.empty(0, FEATURES), "y": torch.empty(0, dtype=torch.long)}
    with torch.no_grad():
        for batch in in_lockstep(batches, empty):
            logits = model(batch["x"])
            loss = nn.functional.cross_entropy(logits, batch["y"], reduction="sum")
            correct = (logits.argmax(dim=1) == batch["y"]).sum()
            totals += torch.tensor([loss.item(), correct.item(), len(logits)], dtype=torch.float64)
    dist.all_reduce(totals)
    loss, correct, rows = totals.tolist()
    return {
        "val_loss": loss / rows,
        "accuracy": correct / rows,
        "eval_world_size": dist.get_world_size(),
    }


validator = TorchTrainerValidator(
    eval_loop,
    scaling_config=ScalingConfig(num_workers=3),  # another world size than training's 2
    datasets={"validation": validation_dataset},
)


def train_func(config):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (torch.from_numpy(a[rank::world]) for a in make_data(1024, seed=0))
    model = build_sharded_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, config["reports"] * 10 + 1):
        rows = slice(step % 8 * 64, step % 8 * 64 + 64)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        if step % 10:
            continue
        # Every rank writes its own shard into its own folder (no rank gathers the model)
        # and reports that folder: ckval stores all of them as one checkpoint.
        with tempfile.TemporaryDirectory() as rank_dir:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=rank_dir)
            report(
                {"step": step, "loss": loss.item()},
                checkpoint=Checkpoint.from_directory(rank_dir),
                validate_fn=validator,
                validation_resources=validator.recommended_resources,
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reports", type=int, default=2)
    parser.add_argument("--run", default="fsdp2-example")
    args = parser.parse_args()
    # On a laptop: room for 2 training and 3 eval workers; Ray's output stays in its logs.
    ray.init(
        num_cpus=max(5, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    train_logging = getattr(ray.train, "LoggingConfig", None)  # Ray 2.56+
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"reports": args.reports},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=args.run,
            storage_path=ray_results_path(),
            **({"logging_config": train_logging(log_level="WARNING")} if train_logging else {}),
        ),
    )
    trainer.fit()
    print(f"training done: {args.reports} sharded checkpoints of 2 ranks reported")

    registry = Registry()
    registry.wait(args.run, timeout_s=600, progress=True)
    for checkpoint, metrics in registry.best_checkpoints(args.run, "accuracy", "max", k=3):
        print(
            f"step {metrics['step']}: accuracy {metrics['accuracy']:.4f} on "
            f"{metrics['eval_world_size']} eval ranks  {checkpoint.path}"
        )


if __name__ == "__main__":
    main()
