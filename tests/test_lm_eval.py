"""LMEvalValidator: a tiny causal LM and its tokenizer made here from a config (nothing
downloaded), lm-eval's simple_evaluate on a local multiple-choice task (a YAML over a
JSONL shipped in tests/data/lm_eval), and the accuracy computed again here from the
model's own log-likelihoods."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ray.train import Checkpoint  # noqa: E402

from tests.inprocess_attempts import InProcessExecutor  # noqa: E402
from validation_service.config import Settings  # noqa: E402
from validation_service.errors import InvalidInput, PermanentValidationError  # noqa: E402
from validation_service.registry.registry import Registry  # noqa: E402
from validation_service.retry import RetryPolicy  # noqa: E402
from validation_service.service.scheduler import Scheduler  # noqa: E402
from validation_service.service.watcher import FolderWatcher  # noqa: E402
from validation_service.validators.lm_eval import LMEvalValidator, flat_metrics  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TASK_YAML = DATA / "tiny_choice.yaml"
TASK = "ckval_tiny_choice"
ROWS = [json.loads(line) for line in (DATA / "tiny_choice.jsonl").read_text().splitlines()]


def tiny_tokenizer():
    """A word-level tokenizer over the task's words, built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for row in ROWS for w in row["question"].split() + row["choices"]})
    vocab = {word: i for i, word in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


def tiny_lm(tokenizer):
    """A 2-layer Llama trained a little on the right answers (so that its accuracy is
    far from chance and from 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    texts = [f"{row['question']} {row['choices'][row['answer']]}" for row in ROWS[:8]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(40):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory) -> Path:
    tokenizer = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("lm") / "checkpoint-40"
    tiny_lm(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "trainer_state.json").write_text("{}")  # as the Trainer's step folders
    return folder


def accuracy_computed_here(folder: Path, rows: list[dict]) -> float:
    """The task's acc without lm-eval: for each question, the choice whose tokens after
    "<question> " have the highest summed log-probability, against the answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    right = 0
    for row in rows:
        context = tokenizer(row["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = tokenizer(f"{row['question']} {choice}", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            scores.append(
                sum(logprobs[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
            )
        right += int(max(range(len(scores)), key=scores.__getitem__) == row["answer"])
    return right / len(rows)


def test_the_accuracy_is_the_one_computed_from_the_models_likelihoods(checkpoint_folder):
    validator = LMEvalValidator([str(TASK_YAML)], batch_size=4)
    metrics = validator(Checkpoint.from_directory(str(checkpoint_folder)), {})
    expected = accuracy_computed_here(checkpoint_folder, ROWS)
    assert 0.4 < expected < 1.0  # trained: neither chance nor perfect
    assert metrics == {f"{TASK}/acc": pytest.approx(expected, abs=1e-12)}
    limited = LMEvalValidator([str(TASK_YAML)], limit=5, batch_size=2)
    first_five = limited(Checkpoint.from_directory(str(checkpoint_folder)), {})
    assert first_five[f"{TASK}/acc"] == pytest.approx(
        accuracy_computed_here(checkpoint_folder, ROWS[:5]), abs=1e-12
    )


def test_a_watched_trainer_folder_is_evaluated_by_lm_eval(checkpoint_folder, tmp_path):
    """The validator travels pickled in a watch's job and runs in an attempt's body."""
    settings = Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        storage=str(tmp_path / "store"),
        watch_interval_s=0.001,
    )
    registry = Registry(settings=settings)
    try:
        validator = LMEvalValidator([str(TASK_YAML)], batch_size=4)
        registry.watch(str(checkpoint_folder.parent), "tiny-lm", validator, validator="lm-eval")
        assert FolderWatcher(registry.watch_listings, settings, "replica/1").tick() == 1
        scheduler = Scheduler(
            registry,
            settings,
            executors={"ray_task": InProcessExecutor(settings)},
            retry_policy=RetryPolicy(backoff_s=0.0),
        )
        deadline = time.monotonic() + 120
        while registry.validations("tiny-lm")[0].status in ("QUEUED", "RUNNING"):
            assert time.monotonic() < deadline
            scheduler.tick()
        [job] = registry.validations("tiny-lm")
        [record] = registry.checkpoints("tiny-lm")
    finally:
        registry.close()
    assert job.status == "SUCCEEDED", job.error_message
    assert record.step == 40
    expected = accuracy_computed_here(checkpoint_folder, ROWS)
    assert record.evaluations["lm-eval"] == {f"{TASK}/acc": pytest.approx(expected, abs=1e-12)}


def test_flat_metric_names():
    results = {
        "hellaswag": {"alias": "hellaswag", "acc,none": 0.5, "acc_stderr,none": "N/A"},
        "gsm8k": {"exact_match,strict-match": 0.25, "sample_len": 7},
    }
    assert flat_metrics(results) == {
        "hellaswag/acc": 0.5,
        "gsm8k/exact_match,strict-match": 0.25,
    }


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"tasks": []}, "tasks must be a list"),
        ({"tasks": [{"dataset_path": "json"}]}, "needs its 'task' name"),
        ({"tasks": ["missing.yaml"]}, "no task YAML file at missing.yaml"),
        ({"tasks": ["hellaswag"], "num_fewshot": -1}, "num_fewshot must be an int"),
        ({"tasks": ["hellaswag"], "limit": 0}, "limit must be a number of documents"),
        ({"tasks": ["hellaswag"], "batch_size": 0}, "batch_size must be"),
        ({"tasks": ["hellaswag"], "model_args": "tokenizer=x"}, "model_args must be a dict"),
    ],
)
def test_bad_arguments_are_refused_when_the_validator_is_made(arguments, expected):
    with pytest.raises(InvalidInput, match=expected):
        LMEvalValidator(**arguments)


def test_a_checkpoint_without_a_tokenizer_says_how_to_give_one(checkpoint_folder, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((checkpoint_folder / name).read_bytes())
    with pytest.raises(PermanentValidationError, match="model_args=\\{'tokenizer'"):
        LMEvalValidator([str(TASK_YAML)])(Checkpoint.from_directory(str(bare)), {})
