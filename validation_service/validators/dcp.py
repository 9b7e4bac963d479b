"""Eval side of sharded checkpoints: load an N-rank ``torch.distributed.checkpoint`` (DCP)
save into a model of any eval world (one process, or M ranks of FSDP2), and keep the
ranks of a sharded model in step while they score uneven shards of a dataset."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from validation_service.errors import CheckpointNotFound, InvalidInput

if TYPE_CHECKING:
    from ray.train import Checkpoint
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["in_lockstep", "load_sharded"]

Batch = TypeVar("Batch")
_METADATA_FILE = ".metadata"
_SHOWN = 8  # keys named in an error at most


def load_sharded(
    model: torch.nn.Module,
    checkpoint: Checkpoint | str | os.PathLike,
    *,
    key: str | None = "model",
    strict: bool = True,
) -> torch.nn.Module:
    """Loads a DCP checkpoint written by N ranks into ``model``, in this world, and returns it.

    The layout is the one of Ray Train's FSDP guide: ``dcp.save({"model":
    get_model_state_dict(model)}, checkpoint_id=folder)`` on every training rank, so that
    one folder holds ``.metadata`` and one ``__<rank>_0.distcp`` per rank (ckval stores
    every rank's folder of a report as one checkpoint). ``key`` is the entry holding the
    model's state dict; ``key=None`` when it was saved at top level
    (``dcp.save(model_state_dict, ...)``). Other entries (an optimizer's) are not read.

    - No process group initialised (a plain Ray task, a ``map_batches`` actor, a
      script): ``model`` is a whole model and gets every tensor.
    - Inside an initialised process group (an eval-only ``TorchTrainer``): a collective
      call, every rank calls it. A model sharded with FSDP2 ``fully_shard`` gets DCP's
      load-time resharding: each rank reads only the pieces of its own shards, whatever
      N was, and no rank holds the whole model.

    ``checkpoint`` is a ``ray.train.Checkpoint`` (read through ``as_directory()``: one on
    remote storage is downloaded whole to each node's disk, while memory holds only this
    rank's shards) or a local folder. Keys and shapes are checked against the
    checkpoint's ``.metadata`` first; with ``strict`` the checkpoint must hold no other
    tensors under ``key``.
    Raises CheckpointNotFound (no such folder) or InvalidInput (no DCP folder, a shard
    file missing, keys or shapes that do not match), the same on every rank.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    with _local_folder(checkpoint) as folder:
        metadata = _read_metadata(folder)
        state_dict = get_model_state_dict(model)
        _check_keys(state_dict, metadata, folder, key, strict)
        wrapped = state_dict if key is None else {key: state_dict}
        _load(wrapped, folder)
    set_model_state_dict(model, state_dict)
    return model


def in_lockstep(batches: Iterable[Batch], empty: Batch) -> Iterator[Batch]:
    """This rank's batches, then ``empty`` until every rank of the process group is done.

    A forward pass of an FSDP-sharded model is collective (each layer gathers its
    parameters from every rank), so all ranks must run the same number of them; shards
    of a dataset split without dropping rows differ by a batch. ``empty`` is a batch of
    zero rows (``{"x": torch.empty(0, 8), "y": torch.empty(0, dtype=torch.long)}``),
    scored like any other. Outside a process group the batches pass through unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield from batches
        return
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        running = torch.tensor([0 if batch is None else 1], device=device)
        dist.all_reduce(running, op=dist.ReduceOp.MAX)
        if not running.item():
            return
        yield empty if batch is None else batch


@contextlib.contextmanager
def _local_folder(checkpoint: Checkpoint | str | os.PathLike) -> Iterator[str]:
    if hasattr(checkpoint, "as_directory"):  # a Checkpoint is PathLike but refuses fspath
        with checkpoint.as_directory() as folder:
            yield folder
        return
    folder = os.fspath(checkpoint)
    if not os.path.isdir(folder):
        raise CheckpointNotFound(folder, "no such folder on this node")
    yield folder


def _read_metadata(folder: str) -> Metadata:
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(folder, _METADATA_FILE)):
        present = sorted(os.listdir(folder))[:_SHOWN]
        raise InvalidInput(
            f"{folder} is not a torch.distributed.checkpoint folder: it has no "
            f"{_METADATA_FILE} file (it holds {present}). Save with dcp.save(...) on every "
            "rank into one folder, or load a torch.save file with model.load_state_dict."
        )
    metadata = FileSystemReader(folder).read_metadata()
    shards = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in shards if not os.path.isfile(os.path.join(folder, name)))
    if missing:
        raise InvalidInput(
            f"The checkpoint {folder} lacks {missing[:_SHOWN]}, which its {_METADATA_FILE} "
            "names: those ranks' files were not stored with it. Report the checkpoint from "
            "every rank, each with its own folder (report(metrics, checkpoint=...))."
        )
    return metadata


def _check_keys(
    state_dict: Mapping[str, Any],
    metadata: Metadata,
    folder: str,
    key: str | None,
    strict: bool,
) -> None:
    prefix = "" if key is None else f"{key}."
    saved = {
        name[len(prefix) :]: entry
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith(prefix)
    }
    missing = sorted(set(state_dict) - set(saved))
    unexpected = sorted(set(saved) - set(state_dict)) if strict else []
    if missing or unexpected:
        if state_dict and len(missing) == len(state_dict):  # none found: another key?
            tops = sorted({name.split(".", 1)[0] for name in metadata.state_dict_metadata})
            todo = f"its top-level entries are {tops[:_SHOWN]}: pass the model's as key="
        elif missing:
            todo = "build the model the training saved"
        else:
            todo = "build the model the training saved, or pass strict=False to ignore them"
        raise InvalidInput(
            f"The model's keys do not match the checkpoint {folder} (key={key!r}): "
            f"missing in the checkpoint {missing[:_SHOWN]}, in the checkpoint but not in "
            f"the model {unexpected[:_SHOWN]} ({len(missing)} and {len(unexpected)} in "
            f"all); {todo}."
        )
    wrong = [
        f"{name}: checkpoint {tuple(saved[name].size)}, model {tuple(value.shape)}"
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
        and hasattr(saved[name], "size")
        and tuple(saved[name].size) != tuple(value.shape)
    ]
    if wrong:
        raise InvalidInput(
            f"The model's tensors do not have the shapes saved in {folder}: "
            f"{'; '.join(wrong[:_SHOWN])}. Build the model with the sizes the training used."
        )


def _load(state_dict: dict[str, Any], folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    if dist.is_available() and dist.is_initialized():
        dcp.load(state_dict, checkpoint_id=folder)
        return
    with warnings.catch_warnings():
        # DCP warns that it loads in one process: that is what no_dist asks for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state_dict, checkpoint_id=folder, no_dist=True)
