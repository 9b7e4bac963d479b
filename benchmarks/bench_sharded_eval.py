"""Validating one sharded checkpoint in eval worlds of another size (issue 33).

A model of about ``--model-mb`` MB (fp32 Linear layers) is sharded with FSDP2 over
``--train-ranks`` gloo processes on the CPU and saved with torch.distributed.checkpoint,
each rank writing its own shard. Then, for each eval world size M in ``--eval-worlds``,
M new processes load it with ``validation_service.validators.dcp.load_sharded``: M = 1
into a whole model (no process group, as a plain validate_fn task does), M > 1 into an
M-way FSDP2 model (DCP reshards as it loads), and run one forward pass over 256 rows
(every rank in step). Per rank: seconds to load, seconds of the forward pass, and peak
RSS (ru_maxrss) against RSS before loading. Medians over ``--repeats``; each repeat's
worlds in rotated order.

    .venv/bin/python benchmarks/bench_sharded_eval.py --model-mb 512 --eval-worlds 1 2 4
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTH = 2048  # each Linear(WIDTH, WIDTH) holds 16 MB of fp32 weights


def make_model(model_mb: int, world: int) -> torch.nn.Module:
    """The model on the CPU, sharded over ``world`` ranks when it is more than 1: built on
    the meta device and sharded before any memory is taken, as large models are."""
    layers = max(1, model_mb // 16)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if world > 1:
        model = shard(model, world)
    return model.to_empty(device="cpu")


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_rank(rank: int, world: int, port: int, folder: str, model_mb: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = make_model(model_mb, world)
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter.to_local(), std=0.01)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def eval_rank(rank: int, world: int, port: int, folder: str, model_mb: int, out) -> None:
    from validation_service.validators.dcp import load_sharded

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_model(model_mb, world)
        before = rss_mb()
        started = time.perf_counter()
        load_sharded(model, folder)
        loaded = time.perf_counter()
        with torch.no_grad():
            model(torch.ones(256 // world, WIDTH))
        forward = time.perf_counter() - loaded
        out.put((world, rank, loaded - started, forward, before, peak_rss_mb()))
    finally:
        if world > 1:
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_world(world: int, folder: str, model_mb: int) -> list[tuple]:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=eval_rank, args=(rank, world, port, folder, model_mb, out))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    rows = [out.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mb", type=int, default=512)
    parser.add_argument("--train-ranks", type=int, default=4)
    parser.add_argument("--eval-worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="ckval-bench-dcp-")
    try:
        mp.start_processes(
            train_rank,
            args=(args.train_ranks, free_port(), folder, args.model_mb),
            nprocs=args.train_ranks,
            start_method="spawn",
        )
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(
            f"checkpoint: {size / 2**20:.0f} MB in {len(os.listdir(folder))} files, "
            f"written by {args.train_ranks} ranks; load {os.getloadavg()[0]:.1f}"
        )
        results: dict[int, list[tuple]] = {world: [] for world in args.eval_worlds}
        for repeat in range(args.repeats):
            shift = repeat % len(args.eval_worlds)
            for world in args.eval_worlds[shift:] + args.eval_worlds[:shift]:
                results[world].extend(run_world(world, folder, args.model_mb))
        print(
            "\n| eval world | load per rank, median (s) | forward, median (s) | "
            "RSS before load (MB) | peak RSS per rank, median (MB) | peak - before (MB) |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for world, rows in results.items():
            load, forward, before, peak = (
                statistics.median(r[i] for r in rows) for i in (2, 3, 4, 5)
            )
            print(
                f"| {world} | {load:.2f} | {forward:.3f} | {before:.0f} | {peak:.0f} | "
                f"{peak - before:.0f} |"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
