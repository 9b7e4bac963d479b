"""validators.hf: a tiny Llama (made from a config here, nothing downloaded) saved as
save_pretrained's safetensors, sharded safetensors with their index, and a DCP folder,
loaded back in one process and into a 2-rank FSDP2 eval world over gloo; the logits equal
those of the model that was saved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.sharded_mlp import free_port
from validation_service.errors import InvalidInput
from validation_service.validators import hf

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
EVAL_RANKS = 2
LAYOUTS = ["safetensors", "sharded-safetensors", "dcp"]


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """One trained-looking model in every layout, and its logits on fixed tokens."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    model.save_pretrained(root / "safetensors")
    model.save_pretrained(root / "sharded-safetensors", max_shard_size="10KB")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=root / "dcp", no_dist=True)
    with torch.no_grad():
        expected = model(tokens()).logits
    torch.save(expected, root / "expected.pt")
    assert len(list((root / "sharded-safetensors").glob("*.safetensors"))) > 1
    return root, expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_process_loads_every_layout(saved, layout):
    root, expected = saved
    options = {"config": tiny_config()} if layout == "dcp" else {}
    assert hf.checkpoint_layout(root / layout) == layout
    model = hf.load_model(str(root / layout), **options).eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens()).logits, expected, atol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again


def eval_rank(rank: int, port: int, root: str) -> None:
    """One of 2 eval ranks: an FSDP2-sharded Llama filled from each layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=EVAL_RANKS)
    expected = torch.load(os.path.join(root, "expected.pt"))
    results = {}
    for layout in LAYOUTS:
        torch.manual_seed(100 + rank)  # each rank starts from other random weights
        model = LlamaForCausalLM(tiny_config())
        mesh = init_device_mesh("cpu", (EVAL_RANKS,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hf.load_model(os.path.join(root, layout), model).eval()
        with torch.no_grad():
            logits = model(tokens()).logits
        params = list(model.parameters())
        held = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
        results[layout] = {
            "max_error": (logits - expected).abs().max().item(),
            "share": held / sum(p.numel() for p in params),
        }
    with open(os.path.join(root, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_an_fsdp2_eval_world_of_two_ranks_loads_every_layout(saved):
    root, _ = saved
    mp.spawn(eval_rank, args=(free_port(), str(root)), nprocs=EVAL_RANKS)
    for rank in range(EVAL_RANKS):
        results = json.loads((root / f"rank-{rank}.json").read_text())
        for layout in LAYOUTS:
            assert results[layout]["max_error"] < 1e-5, (rank, layout, results)
            assert results[layout]["share"] < 0.75  # no rank holds the whole model


def test_a_dcp_folder_becomes_a_save_pretrained_folder(saved, tmp_path):
    from transformers import LlamaForCausalLM

    root, expected = saved
    out = hf.save_pretrained_from_dcp(root / "dcp", tmp_path / "hf", config=tiny_config())
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(out))
    model = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens()).logits, expected, atol=1e-5)


def test_what_cannot_be_loaded_is_refused_naming_it(saved, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    root, _ = saved
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(InvalidInput, match=r"holds no model weights .*'notes.txt'"):
        hf.load_model(tmp_path / "empty")
    with pytest.raises(InvalidInput, match="no config.json .* Pass config="):
        hf.load_model(root / "dcp")
    wider = LlamaConfig(**{**tiny_config().to_dict(), "hidden_size": 32})
    with pytest.raises(InvalidInput, match="shapes saved in"):
        hf.load_model(root / "safetensors", LlamaForCausalLM(wider))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(root / "sharded-safetensors"):
        if not name.startswith("model-00002"):
            (broken / name).write_bytes((root / "sharded-safetensors" / name).read_bytes())
    with pytest.raises(InvalidInput, match="names shards that are not there.*00002"):
        hf.load_model(broken)
