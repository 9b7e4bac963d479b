"""Sharded checkpoints in Ray Train: every rank reports its own folder (FSDP2 and
torch.distributed.checkpoint on gloo), and the union is one checkpoint, validated once
every rank's part is stored; a rank that dies mid-copy leaves an incomplete checkpoint
that is never validated."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

import cloudpickle
import pytest
import ray.cloudpickle
import ray.train
import torch

from trainer_integration import CheckpointUploadMode, report, resolve_checkpoint
from validation_service.jobs import AssemblyStatus
from validation_service.registry.registry import Registry

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WIDTH = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    )


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(64, WIDTH, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def mse(model: torch.nn.Module) -> float:
    x, y = held_out()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def validate_whole(checkpoint, config) -> dict:
    """One process, no process group: DCP loads every rank's shard into a whole model."""
    import torch.distributed.checkpoint as dcp

    model = make_model()
    state = {"model": model.state_dict()}
    with checkpoint.as_directory() as directory:
        dcp.load(state, checkpoint_id=directory, no_dist=True)
        files = sorted(os.listdir(directory))
    model.load_state_dict(state["model"])
    return {"mse": mse(model), "distcp_files": sum(f.endswith(".distcp") for f in files)}


def train_sharded(config) -> None:
    """FSDP2 on a CPU mesh (gloo); each report, every rank saves its shard with DCP into a
    folder of its own and reports it, as Ray Train's FSDP guide does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = held_out()
    for step, mode in enumerate(config["modes"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state = {"model": get_model_state_dict(model)}
        if mode == "NO_UPLOAD":  # every rank writes into one shared folder
            folder = os.path.join(config["shared"], f"step-{step}")
        else:
            folder = tempfile.mkdtemp(prefix=f"rank{rank}-step{step}-")
        dcp.save(state, checkpoint_id=folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write('{"width": 8}')  # written alike by every rank: stored once
        if mode == "RANK_1_ONLY":  # a step where only rank 1 passes a folder
            _report_from_rank_1_only(rank, step)
            continue
        kill = rank == 1 and step == config.get("kill_rank_1_at") and _first_attempt(config)
        if kill:
            _wait_for_checkpoints(context.get_experiment_name(), step)  # earlier ones sealed
            with open(os.path.join(folder, "padding.bin"), "wb") as f:
                f.write(os.urandom(64 * 1024 * 1024))
        report(
            {"step": step, "loss": float(loss)},
            ray.train.Checkpoint.from_directory(folder),
            validate_fn=validate_whole,
            checkpoint_upload_mode=CheckpointUploadMode[mode],
        )
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)  # its copy has only begun (ASYNC)


def _report_from_rank_1_only(rank: int, step: int) -> None:
    folder = tempfile.mkdtemp(prefix=f"rank{rank}-step{step}-")
    with open(os.path.join(folder, f"rank-{rank}.txt"), "w") as f:
        f.write(str(rank))
    checkpoint = ray.train.Checkpoint.from_directory(folder) if rank == 1 else None
    report({"step": step}, checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)


def _wait_for_checkpoints(run: str, count: int) -> None:
    """Waits until the run's first ``count`` reports are checkpoints (sealed), so that only
    the report made after this one is cut short."""
    import time

    from validation_service.registry.registry import Registry

    registry, deadline = Registry(), time.monotonic() + 120
    while len(registry.checkpoints(run)) < count:
        assert time.monotonic() < deadline, f"{count} checkpoint(s) of {run} not sealed in 120 s"
        time.sleep(0.05)
    registry.close()


def _first_attempt(config) -> bool:
    marker = os.path.join(config["shared"], "killed-once")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def fit(run: str, session_home, **config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_sharded,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run,
            storage_path=str(session_home / "ray_results"),
            failure_config=FailureConfig(max_failures=config.get("max_failures", 0)),
        ),
    ).fit()


def consolidated_mse(uri: str, tmp_path) -> float:
    """The metric of the whole model, consolidated from the stored checkpoint by DCP's own
    converter, independently of ckval."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"whole-{os.path.basename(uri)}.pt"
    dcp_to_torch_save(uri, str(target))
    model = make_model()
    model.load_state_dict(torch.load(target)["model"])
    return mse(model)


def test_every_ranks_shard_is_one_checkpoint_in_each_upload_mode(
    service, session_home, unique_run, tmp_path
):
    shared = tmp_path / "shared"
    shared.mkdir()
    modes = ["ASYNC", "SYNC", "NO_UPLOAD", "RANK_1_ONLY"]
    result = fit(unique_run, session_home, modes=modes, shared=str(shared))
    assert result.error is None
    registry = Registry()
    registry.wait(unique_run, timeout_s=180, raise_on_failure=True)
    records = registry.checkpoints(unique_run)
    assert [r.reported_metrics["step"] for r in records] == [0, 1, 2, 3]
    # Only rank 1 passed a folder at step 3: the checkpoint is what it passed.
    assert sorted(os.listdir(records[3].uri)) == [".ckval-manifest.json", "rank-1.txt"]
    assert records[3].validation_status == "NONE"
    records = records[:3]
    for record in records:
        files = sorted(os.listdir(record.uri))
        # Both ranks' shards, rank 0's metadata, the file both wrote alike, one manifest.
        assert [f for f in files if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
        assert ".metadata" in files and "config.json" in files
        assert not [f for f in files if f.startswith(".ckval-part-")]
        assert record.validation_status == "VALIDATED"
        assert record.metrics["distcp_files"] == 2
        assert record.metrics["mse"] == pytest.approx(consolidated_mse(record.uri, tmp_path))
    assert records[2].uri == str(shared / "step-2")  # NO_UPLOAD: registered where it is
    assert registry.incomplete_checkpoints(unique_run) == []
    # Ray Train's Result lists each report once, as a pointer to ckval's checkpoint.
    resolved = [resolve_checkpoint(c).path for c, _ in result.best_checkpoints]
    assert resolved[:3] == [r.uri for r in records]


def test_a_rank_killed_mid_copy_leaves_an_incomplete_checkpoint_never_validated(
    service, session_home, unique_run, tmp_path
):
    shared = tmp_path / "shared"
    shared.mkdir()
    result = fit(
        unique_run,
        session_home,
        modes=["ASYNC", "ASYNC"],
        shared=str(shared),
        kill_rank_1_at=1,
        max_failures=1,
    )
    assert result.error is None  # the restarted worker group reported both steps again
    registry = Registry()
    registry.wait(unique_run, timeout_s=180, raise_on_failure=True)
    records = registry.checkpoints(unique_run)
    # First group: step 0 sealed; step 1's rank 1 died mid-copy. Second group: 0 and 1.
    assert [r.reported_metrics["step"] for r in records] == [0, 0, 1]
    assert all(r.validation_status == "VALIDATED" for r in records)
    incomplete = registry.incomplete_checkpoints(unique_run)
    assert len(incomplete) == 1
    (broken,) = incomplete
    assert broken.status is AssemblyStatus.INCOMPLETE
    assert broken.report_index not in [r.report_index for r in records]
    assert 1 not in broken.ranks
    latest = registry.latest_checkpoint(unique_run)
    assert latest.path == records[-1].uri
    assert os.path.exists(broken.uri)  # its partial parts are there until retention
    registry.apply_retention(unique_run, metric="mse", mode="min", keep_latest=3)
    assert not os.path.exists(broken.uri)
    assert registry.incomplete_checkpoints(unique_run)[0].deleted_at is not None
    assert [r.report_index for r in registry.checkpoints(unique_run)] == [
        r.report_index for r in records
    ]
