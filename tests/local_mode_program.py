"""Ray Train's local mode under torchrun, with ckval's report() on every rank.

    torchrun --standalone --nproc-per-node=2 tests/local_mode_program.py RUN SCRATCH

Each torchrun process runs the train function itself (``ScalingConfig(num_workers=0)``:
Ray Train's local mode, no Ray workers), every rank reporting its own shard folder at
each of three steps with a validate_fn. Writes what each rank's report() did to
``SCRATCH/rank-<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from trainer_integration import report


def count_shards(checkpoint, config) -> dict:
    with checkpoint.as_directory() as directory:
        return {"shards": float(len([n for n in os.listdir(directory) if n.startswith("shard")]))}


def train_func(config):
    context = ray.train.get_context()
    rank = context.get_world_rank()
    done = []
    for step in range(3):
        folder = tempfile.mkdtemp(dir=config["scratch"])
        with open(os.path.join(folder, f"shard-{rank}.json"), "w") as f:
            json.dump({"step": step, "rank": rank}, f)
        report(
            {"step": step}, ray.train.Checkpoint.from_directory(folder), validate_fn=count_shards
        )
        done.append(step)
    with open(os.path.join(config["scratch"], f"rank-{rank}.json"), "w") as f:
        json.dump({"world_size": context.get_world_size(), "done": done}, f)


if __name__ == "__main__":
    run, scratch = sys.argv[1], sys.argv[2]
    TorchTrainer(
        train_func,
        train_loop_config={"scratch": scratch},
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name=run),
    ).fit()
