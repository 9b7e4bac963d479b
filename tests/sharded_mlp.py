"""A tiny MLP trained by 2 FSDP2 ranks over gloo, each saving its DCP shard: the sharded
checkpoint of the sharded-validation tests. Imports torch and numpy only, so that the
spawned training processes start fast."""

from __future__ import annotations

import os
import socket

import numpy as np
import torch
import torch.distributed as dist

FEATURES, CLASSES = 8, 4
TRAIN_RANKS = 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, CLASSES),
    )


def make_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by the largest of their first 4 coordinates: learnable, deterministic."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    return x, x[:, :CLASSES].argmax(axis=1).astype(np.int64)


def shard(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """FSDP2 on a CPU mesh of the default (gloo) group: each Linear, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_rank(rank: int, port: int, folder: str) -> None:
    """One of 2 FSDP2 training ranks: a few SGD steps on its half, then its DCP shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TRAIN_RANKS)
    try:
        model = shard(make_model(), TRAIN_RANKS)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        x, y = (torch.from_numpy(a[rank::TRAIN_RANKS]) for a in make_data(512, seed=0))
        for step in range(30):
            rows = slice(step % 4 * 64, step % 4 * 64 + 64)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
