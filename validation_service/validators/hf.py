"""Hugging Face checkpoints on the eval side: a Transformers model loaded from a folder
that the Trainer or ``save_pretrained`` wrote (safetensors, sharded safetensors with
their index, ``pytorch_model.bin``) or from a ``torch.distributed.checkpoint`` (DCP)
folder, in one process or in an eval world of M ranks (as ``load_sharded`` does for
plain modules); and a DCP folder written out as a ``save_pretrained`` folder, through
torch's DCP-to-safetensors writer, for tools that read only that layout.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from validation_service.errors import InvalidInput
from validation_service.validators.dcp import _local_folder, load_sharded

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = ["checkpoint_layout", "load_model", "save_pretrained_from_dcp"]

DCP = "dcp"
SAFETENSORS = "safetensors"
SHARDED_SAFETENSORS = "sharded-safetensors"
PYTORCH_BIN = "pytorch-bin"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SHOWN = 8


def checkpoint_layout(folder: str | os.PathLike) -> str:
    """Which layout a checkpoint folder has: "dcp" (a ``.metadata`` file, DCP's),
    "sharded-safetensors" (``model.safetensors.index.json`` and its shards),
    "safetensors" (``*.safetensors`` files) or "pytorch-bin" (``pytorch_model.bin``).
    InvalidInput naming what the folder holds otherwise."""
    names = set(os.listdir(folder))
    if ".metadata" in names:
        return DCP
    if SAFETENSORS_INDEX in names:
        _check_index(folder, names)
        return SHARDED_SAFETENSORS
    if any(name.endswith(".safetensors") for name in names):
        return SAFETENSORS
    if "pytorch_model.bin" in names:
        return PYTORCH_BIN
    raise InvalidInput(
        f"{folder} holds no model weights ckval can read (it holds "
        f"{sorted(names)[:_SHOWN]}): save with trainer.save_model() / model.save_pretrained() "
        "(safetensors) or dcp.save() (a torch.distributed.checkpoint folder)."
    )


def _check_index(folder: str | os.PathLike, names: set[str]) -> None:
    with open(os.path.join(folder, SAFETENSORS_INDEX)) as f:
        shards = set(json.load(f).get("weight_map", {}).values())
    missing = sorted(shards - names)
    if missing:
        raise InvalidInput(
            f"{folder}'s {SAFETENSORS_INDEX} names shards that are not there: "
            f"{missing[:_SHOWN]}. Save the whole folder again (save_pretrained writes every "
            "shard before the index)."
        )


def load_model(
    checkpoint: Checkpoint | str | os.PathLike,
    model: torch.nn.Module | None = None,
    *,
    model_class: Any = None,
    config: Any = None,
    key: str | None = "model",
    strict: bool = True,
    **from_pretrained: Any,
) -> torch.nn.Module:
    """A Transformers model with the checkpoint's weights, in this world.

    - One process, no ``model``, a Hugging Face layout: ``model_class.from_pretrained``
      (default ``AutoModelForCausalLM``; ``from_pretrained``'s keyword arguments pass on).
    - A DCP folder, or ``model`` given, or inside an initialised process group: the
      weights go into ``model`` (default: ``model_class.from_config(config)``, the
      folder's ``config.json`` unless ``config`` is given). A collective call there:
      every rank calls it, and a model sharded with FSDP2 ``fully_shard`` reads only its
      own pieces, whatever layout and however many ranks wrote it (DCP's resharding;
      safetensors read through torch's ``HuggingFaceStorageReader``). ``key``: the DCP
      entry holding the model's state dict (``key=None``: at top level).

    Tied weights (an ``lm_head`` sharing the embeddings) are tied again after loading.
    Raises InvalidInput naming what does not match (keys, shapes, a missing config).
    """
    model_class = model_class or _auto_causal_lm()
    with _local_folder(checkpoint) as folder:
        layout = checkpoint_layout(folder)
        distributed = dist.is_available() and dist.is_initialized()
        if model is None and layout != DCP and not distributed:
            return model_class.from_pretrained(folder, **from_pretrained)
        if model is None:
            model = model_class.from_config(_config(folder, config))
        if layout == DCP:
            load_sharded(model, folder, key=key, strict=strict)
        elif layout == PYTORCH_BIN:
            state = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
            _load_whole(model, state, folder, strict)
        else:
            _load_safetensors(model, folder, strict, distributed)
    _tie(model)
    return model


def save_pretrained_from_dcp(
    checkpoint: Checkpoint | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: Any,
    model_class: Any = None,
    key: str | None = "model",
) -> str:
    """Writes a DCP checkpoint of a Transformers model as a ``save_pretrained`` folder
    (``config.json``, ``model-00001-of-00001.safetensors`` and its index) with torch's
    DCP-to-safetensors writer (``HuggingFaceStorageWriter``), in one process; returns
    ``out_dir``. For tools that read only that layout (lm-eval's command line, vLLM)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model_class = model_class or _auto_causal_lm()
    model = model_class.from_config(_config(None, config))
    load_model(checkpoint, model, key=key)
    os.makedirs(out_dir, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in _untied_state(model).items()}
    with warnings.catch_warnings():
        # DCP warns that it saves in one process: that is what no_dist asks for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out_dir)), no_dist=True)
    model.config.save_pretrained(out_dir)
    return str(out_dir)


def _auto_causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _config(folder: str | None, config: Any):
    """The model's config: ``config`` (a PretrainedConfig, or a path or dict), else the
    folder's config.json."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        kind = config.get("model_type")
        if not kind:
            raise InvalidInput("config as a dict needs its model_type, e.g. 'llama'")
        return AutoConfig.for_model(**config)
    source = config if config is not None else folder
    if source is None or not os.path.isfile(os.path.join(source, "config.json")):
        raise InvalidInput(
            f"no config.json in {source}: a DCP folder holds weights only. Pass config= "
            "(the model's PretrainedConfig, or the folder of its config.json)."
        )
    return AutoConfig.from_pretrained(source)


def _tied(model: torch.nn.Module) -> set[str]:
    """The state dict's names that share their parameter with an earlier name."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def _tie(model: torch.nn.Module) -> None:
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _untied_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tied = _tied(model)
    return {name: t for name, t in model.state_dict().items() if name not in tied}


def _check_names(model_names, saved_names, tied, folder, strict: bool) -> None:
    missing = sorted(set(model_names) - set(saved_names) - set(tied))
    unexpected = sorted(set(saved_names) - set(model_names)) if strict else []
    if missing or unexpected:
        raise InvalidInput(
            f"The model's weights do not match the checkpoint {folder}: missing in the "
            f"checkpoint {missing[:_SHOWN]}, in the checkpoint but not in the model "
            f"{unexpected[:_SHOWN]} ({len(missing)} and {len(unexpected)} in all). Build "
            "the model the training saved (its config.json), or pass strict=False to "
            "ignore weights the model does not have."
        )


def _load_whole(model: torch.nn.Module, state: dict, folder: str, strict: bool) -> None:
    _check_names(model.state_dict(), state, _tied(model), folder, strict)
    model.load_state_dict(state, strict=False)


def _load_safetensors(model: torch.nn.Module, folder: str, strict: bool, distributed: bool):
    """Safetensors (one file, shards with their index, or a DCP save in that format) read
    as a DCP checkpoint, so that each rank of an FSDP2 model reads only its pieces."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state = get_model_state_dict(model)
    saved = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata
    _check_names(state, saved, _tied(model), folder, strict)
    wanted = {name: tensor for name, tensor in state.items() if name in saved}
    wrong = [
        f"{name}: checkpoint {tuple(saved[name].size)}, model {tuple(tensor.shape)}"
        for name, tensor in wanted.items()
        if tuple(saved[name].size) != tuple(tensor.shape)
    ]
    if wrong:
        raise InvalidInput(
            f"The model's tensors do not have the shapes saved in {folder}: "
            f"{'; '.join(wrong[:_SHOWN])}. Build the model with the training's config."
        )
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(folder), no_dist=not distributed)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
