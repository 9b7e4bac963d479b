"""Real gloo, FSDP2 and DCP: a checkpoint written by 2 sharded training ranks, validated in one
process, by eval-only TorchTrainers of 1 and 3 FSDP2 workers, and by map_batches actors."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle
import ray.data
import ray.train
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ray.train import Checkpoint, ScalingConfig

from tests import sharded_mlp
from tests.sharded_mlp import (
    FEATURES,
    TRAIN_RANKS,
    free_port,
    make_data,
    make_model,
    shard,
    train_rank,
)
from trainer_integration import CheckpointUploadMode, Client
from validation_service.errors import CheckpointNotFound, InvalidInput
from validation_service.registry.registry import Registry
from validation_service.validators.dcp import in_lockstep, load_sharded
from validation_service.validators.map_batches import MapBatchesValidator
from validation_service.validators.torch_trainer import TorchTrainerValidator

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module: ship its functions and classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
for pickler in (cloudpickle, ray.cloudpickle):
    pickler.register_pickle_by_value(sharded_mlp)

WAIT_S = 240
# 250 rows in 4 blocks, batches of 64: split across 3 eval ranks without dropping rows, one
# rank gets 2 blocks (2 batches), another 1 or none; in_lockstep keeps their FSDP2 forward
# passes in step.
VAL_ROWS = 250
BATCH = 64
EMPTY_BATCH = {"x": torch.empty(0, FEATURES), "y": torch.empty(0, dtype=torch.long)}
X_VAL, Y_VAL = make_data(VAL_ROWS, seed=1)


def validation_dataset() -> ray.data.Dataset:
    """A zero-argument dataset source: built where the validation runs."""
    rows = [{"x": x, "y": int(y)} for x, y in zip(X_VAL, Y_VAL, strict=True)]
    return ray.data.from_items(rows, override_num_blocks=4)


def score(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, correct rows, rows] of one batch, in float64."""
    logits = model(x.float())
    loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
    correct = (logits.argmax(dim=1) == y).sum()
    return torch.stack([loss.double(), correct.double(), torch.tensor(len(y)).double()])


def metrics_of(totals: torch.Tensor) -> dict[str, float]:
    loss, correct, rows = totals.tolist()
    return {"loss": loss / rows, "accuracy": correct / rows, "rows": rows}


def whole_model_metrics(model: torch.nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return metrics_of(score(model.eval(), torch.from_numpy(X_VAL), torch.from_numpy(Y_VAL)))


# ------------------------------------------------------------------ validators under test


def validate_whole_model(checkpoint: Checkpoint, config: dict) -> dict:
    """A plain validate_fn (a Ray task of its own): the whole model in one process."""
    return whole_model_metrics(load_sharded(make_model(), checkpoint))


def fsdp2_eval_loop(config: dict) -> dict:
    """Eval-only Ray Train loop: an M-way FSDP2 model, each rank scoring its shard of rows."""
    from torch.distributed.tensor import DTensor

    world_size = ray.train.get_context().get_world_size()
    model = load_sharded(shard(make_model(), world_size), config["checkpoint"]).eval()
    params = list(model.parameters())
    held = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
    totals = torch.zeros(3, dtype=torch.float64)
    own_batches = 0
    batches = ray.train.get_dataset_shard("validation").iter_torch_batches(batch_size=BATCH)
    with torch.no_grad():
        for batch in in_lockstep(batches, EMPTY_BATCH):
            totals += score(model, batch["x"], batch["y"])
            own_batches += len(batch["y"]) > 0
    dist.all_reduce(totals)
    # The largest share of the model any rank holds, and the most and fewest batches.
    most = torch.tensor([held, sum(p.numel() for p in params), own_batches, -own_batches])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return {
        **metrics_of(totals),
        "max_rank_share": most[0].item() / most[1].item(),
        "most_batches": most[2].item(),
        "fewest_batches": -most[3].item(),
    }


def fsdp2_validator(num_workers: int) -> TorchTrainerValidator:
    return TorchTrainerValidator(
        fsdp2_eval_loop,
        scaling_config=ScalingConfig(num_workers=num_workers),
        datasets={"validation": validation_dataset},
    )


class WholeModelPredictor:
    """A map_batches actor: no process group, the whole model loaded from every shard."""

    def __init__(self, checkpoint: Checkpoint):
        self.model = load_sharded(make_model(), checkpoint).eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x, y = torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])
        with torch.no_grad():
            logits = self.model(x)
            loss = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        return {"correct": (logits.argmax(dim=1) == y).numpy(), "loss": loss.double().numpy()}


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory) -> Path:
    """A DCP checkpoint of 2 FSDP2 ranks, written by 2 processes over gloo."""
    folder = tmp_path_factory.mktemp("fsdp2-dcp")
    mp.spawn(train_rank, args=(free_port(), str(folder)), nprocs=TRAIN_RANKS)
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    return folder


@pytest.fixture(scope="module")
def expected(dcp_folder, tmp_path_factory) -> dict[str, float]:
    """The metrics of the whole model, consolidated by DCP's own converter (no ckval code)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path_factory.mktemp("consolidated") / "model.pt"
    dcp_to_torch_save(dcp_folder, whole)
    model = make_model()
    model.load_state_dict(torch.load(whole)["model"])
    metrics = whole_model_metrics(model)
    untrained = whole_model_metrics(make_model())
    assert metrics["accuracy"] > untrained["accuracy"] + 0.2, (metrics, untrained)
    return metrics


def assert_metrics_match(metrics: dict, expected: dict) -> None:
    assert metrics["rows"] == VAL_ROWS
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-5)


# ------------------------------------------------------------------------------- tests


def test_one_process_loads_the_whole_model_from_every_shard(dcp_folder, expected):
    from_path = load_sharded(make_model(), dcp_folder)
    from_checkpoint = load_sharded(make_model(), Checkpoint.from_directory(str(dcp_folder)))
    assert_metrics_match(whole_model_metrics(from_path), expected)
    assert_metrics_match(whole_model_metrics(from_checkpoint), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_state_dict_saved_at_top_level_loads_with_key_none(tmp_path, dcp_folder, expected):
    import torch.distributed.checkpoint as dcp

    model = load_sharded(make_model(), dcp_folder)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    assert_metrics_match(
        whole_model_metrics(load_sharded(make_model(), tmp_path, key=None)), expected
    )
    with pytest.raises(InvalidInput, match=r"top-level entries are \['0'"):
        load_sharded(make_model(), tmp_path)  # key="model": no such entry


def test_torch_trainer_validator_reshards_into_one_fsdp2_worker(ray_session, dcp_folder, expected):
    metrics = fsdp2_validator(1)(Checkpoint.from_directory(str(dcp_folder)), {})
    assert_metrics_match(metrics, expected)
    assert metrics["max_rank_share"] == 1.0  # a world of 1 holds every shard


def test_map_batches_actors_each_load_the_whole_model(ray_session, dcp_folder, expected):
    validator = MapBatchesValidator(
        WholeModelPredictor, validation_dataset, batch_size=BATCH, concurrency=2
    )
    metrics = validator(Checkpoint.from_directory(str(dcp_folder)), {})
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-5)
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)


def test_service_validates_the_checkpoint_in_a_ray_task_and_in_three_fsdp2_workers(
    service, dcp_folder, expected, unique_run
):
    validator = fsdp2_validator(3)
    client = Client(unique_run)
    for validate_fn, resources in (
        (validate_whole_model, {"num_cpus": 1}),
        (validator, validator.recommended_resources),
    ):
        client.report(
            {"train_ranks": TRAIN_RANKS},
            Checkpoint.from_directory(str(dcp_folder)),
            validate_fn=validate_fn,
            validation_resources=resources,
            checkpoint_upload_mode=CheckpointUploadMode.SYNC,
            max_attempts=1,
        )
    registry = Registry()
    registry.wait(unique_run, timeout_s=WAIT_S)
    jobs = registry.validations(unique_run)
    assert [job.status for job in jobs] == ["SUCCEEDED"] * 2, [
        (job.status, job.error_message) for job in jobs
    ]
    in_task, in_three_workers = registry.checkpoints(unique_run)
    for record in (in_task, in_three_workers):
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(record.uri))
        assert_metrics_match(record.validated_metrics, expected)
    # 3 ranks of a model of 3 Linear layers: no rank held more than about a third of it.
    assert in_three_workers.validated_metrics["max_rank_share"] < 0.4
    # Ranks with fewer batches ran empty ones while the others finished theirs.
    validated = in_three_workers.validated_metrics
    assert validated["most_batches"] > validated["fewest_batches"]


# --------------------------------------------------------------------------- bad input


def test_a_folder_without_metadata_is_refused_naming_what_is_missing(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(
        InvalidInput, match="not a torch.distributed.checkpoint folder.*no .metadata"
    ):
        load_sharded(make_model(), tmp_path)
    with pytest.raises(CheckpointNotFound, match="no such folder"):
        load_sharded(make_model(), tmp_path / "absent")


def test_a_checkpoint_missing_a_rank_s_shard_is_refused_naming_the_file(tmp_path, dcp_folder):
    partial = tmp_path / "rank0-only"
    shutil.copytree(dcp_folder, partial)
    (partial / "__1_0.distcp").unlink()
    with pytest.raises(
        InvalidInput, match=r"lacks \[.__1_0.distcp.\].*Report the checkpoint from every rank"
    ):
        load_sharded(make_model(), partial)


def test_a_model_whose_keys_or_shapes_differ_is_refused_naming_them(dcp_folder):
    shorter = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU())
    with pytest.raises(
        InvalidInput, match=r"but not in the model \['2.bias', '2.weight', '4.bias'"
    ):
        load_sharded(shorter, dcp_folder)
    # strict=False: a model that is a prefix of the saved one gets its own tensors.
    load_sharded(shorter, dcp_folder, strict=False)
    whole = load_sharded(make_model(), dcp_folder)
    assert torch.equal(shorter[0].weight, whole[0].weight)
    renamed = torch.nn.ModuleDict({"encoder": make_model()})
    with pytest.raises(InvalidInput, match=r"missing in the checkpoint \['encoder.0.bias'"):
        load_sharded(renamed, dcp_folder)
    narrower = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16))
    with pytest.raises(InvalidInput, match=r"0.weight: checkpoint \(32, 8\), model \(16, 8\)"):
        load_sharded(narrower, dcp_folder, strict=False)
