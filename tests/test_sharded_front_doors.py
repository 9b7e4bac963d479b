"""Sharded saves through the front doors: Lightning's distributed checkpoints in Ray Train
(ModelParallelStrategy with FSDP2; FSDPStrategy's FSDP1 needs an accelerator), where
every rank writes its shard at rank 0's path: each rank reports its own files, and
validation sees the whole checkpoint. And which files of a shared folder are a rank's."""

from __future__ import annotations

import importlib.util
import os
import sys

import cloudpickle
import pytest
import ray.cloudpickle
import torch

from trainer_integration._rank_files import file_rank, is_sharded, take_own_files
from validation_service.registry.registry import Registry

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_the_files_of_a_shared_folder_are_split_by_the_rank_that_wrote_them(tmp_path):
    shared = tmp_path / "shared"
    names = [
        "model/__0_0.distcp",
        "model/__1_0.distcp",
        "model/.metadata",
        "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "config.json",
    ]
    for name in names:
        (shared / name).parent.mkdir(parents=True, exist_ok=True)
        (shared / name).write_text(name)
    assert [file_rank(os.path.basename(n)) for n in names] == [0, 1, None, 1, 0, None]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.pt").write_text("whole")
    assert is_sharded(str(shared)) and not is_sharded(str(plain))
    taken = {}
    for rank in (0, 1):
        target = tmp_path / f"rank-{rank}"
        take_own_files(str(shared), rank, str(target))
        taken[rank] = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert taken[0] == sorted(
        [
            "config.json",
            "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "model/.metadata",
            "model/__0_0.distcp",
        ]
    )
    assert taken[1] == sorted(
        ["global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt", "model/__1_0.distcp"]
    )
    assert sorted(taken[0] + taken[1]) == sorted(names)  # the union is the whole save


lightning_missing = importlib.util.find_spec("lightning") is None


def validate_sharded_lightning(checkpoint, config) -> dict:
    """Loads the Lightning sharded save (every rank's shard) into a whole model."""
    import torch.distributed.checkpoint as dcp

    from trainer_integration.lightning import CHECKPOINT_NAME
    from validation_service.cli.demo import load_digits_split, make_model

    model = make_model()
    # ModelParallelStrategy saves the module's state under "state_dict".
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    with checkpoint.as_directory() as directory:
        folder = os.path.join(directory, CHECKPOINT_NAME)
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        shards = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    _, x_val, _, y_val = load_digits_split()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(dim=1).numpy()
    return {"val_acc": float((predicted == y_val).mean()), "shards": len(shards)}


def train_lightning_fsdp(config) -> None:
    """FSDP2 through Lightning's ModelParallelStrategy (its FSDPStrategy, FSDP1, needs an
    accelerator): a distributed checkpoint, each rank's shard at rank 0's path."""
    import lightning.pytorch as pl
    import ray.train
    from lightning.pytorch.strategies import ModelParallelStrategy
    from ray.train.lightning import RayLightningEnvironment
    from torch.distributed.fsdp import fully_shard

    from tests.test_lightning import DigitsModule, digits_loader
    from trainer_integration.lightning import ReportCheckpointCallback

    class ShardedDigits(DigitsModule):
        def configure_model(self):
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    torch.manual_seed(0)
    context = ray.train.get_context()
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        # As Ray's own strategies do: each process one device of its node's.
        devices=context.get_local_world_size(),
        num_nodes=context.get_world_size() // context.get_local_world_size(),
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[RayLightningEnvironment()],
        callbacks=[ReportCheckpointCallback(validate_fn=validate_sharded_lightning)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    # No prepare_trainer(): it admits Ray's three strategies only; RayLightningEnvironment
    # gives Lightning the ranks, and the process group is Ray Train's.
    trainer.fit(ShardedDigits(), digits_loader(context.get_world_rank(), context.get_world_size()))


@pytest.mark.ray
@pytest.mark.skipif(lightning_missing, reason='pip install "ckval[lightning]"')
def test_lightning_fsdp_sharded_saves_land_whole(service, session_home, unique_run, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import tests.test_lightning

    cloudpickle.register_pickle_by_value(tests.test_lightning)
    ray.cloudpickle.register_pickle_by_value(tests.test_lightning)
    result = TorchTrainer(
        train_lightning_fsdp,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=unique_run, storage_path=str(session_home / "ray_results")),
    ).fit()
    assert result.error is None
    registry = Registry()
    registry.wait(unique_run, timeout_s=180, raise_on_failure=True)
    records = registry.checkpoints(unique_run)
    assert [r.epoch for r in records] == [0, 1]
    for record in records:
        assert record.metrics["shards"] == 2  # both ranks' shards, in one checkpoint
        folder = os.path.join(record.uri, "checkpoint.ckpt")
        assert sorted(os.listdir(folder)) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "meta.pt",
        ]
        assert record.metrics["val_acc"] == pytest.approx(consolidated_accuracy(folder, tmp_path))


def consolidated_accuracy(folder: str, tmp_path) -> float:
    """The accuracy of the whole model consolidated by DCP's own converter, numpy only."""
    import numpy as np
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from validation_service.cli.demo import load_digits_split

    target = tmp_path / f"{os.path.basename(os.path.dirname(folder))}.pt"
    dcp_to_torch_save(folder, str(target))
    saved = torch.load(target, weights_only=False)["state_dict"]
    state = {k.removeprefix("model."): v.numpy() for k, v in saved.items()}
    _, x_val, _, y_val = load_digits_split()
    hidden = np.maximum(x_val @ state["0.weight"].T + state["0.bias"], 0)
    logits = hidden @ state["2.weight"].T + state["2.bias"]
    return float(np.mean(logits.argmax(axis=1) == y_val))
