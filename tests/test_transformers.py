"""Real Hugging Face Transformers on CPU: the TrainerCallback in Ray Train and in a plain
script, and TransformersValidator, with tiny models built from a config (nothing is
downloaded)."""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle

if importlib.util.find_spec("transformers") is None:
    pytest.skip(
        'Transformers is not installed: pip install "ckval[transformers]"', allow_module_level=True
    )

import torch
from datasets import Dataset
from ray.train import Checkpoint
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from trainer_integration import CheckpointUploadMode
from trainer_integration.transformers import ReportCheckpointCallback, load_best_model
from validation_service.context import current_validation
from validation_service.errors import InvalidInput, ValidationsFailedWarning
from validation_service.registry.registry import Registry
from validation_service.validators.transformers import TransformersValidator

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

# Ray workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEQUENCE = 8


# ------------------------------------------------------------------ tiny models and data
def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def token_rows(count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Integer token ids; the label is whether the first token is in the upper half."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (count, SEQUENCE), generator=generator)
    return ids.tolist(), (ids[:, 0] >= 32).long().tolist()


def train_dataset() -> Dataset:
    ids, labels = token_rows(64, seed=0)
    return Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * SEQUENCE] * 64, "labels": labels}
    )


def eval_dataset() -> Dataset:
    ids, labels = token_rows(24, seed=1)
    return Dataset.from_dict({"input_ids": ids, "labels": labels})


def independent_metrics(checkpoint_dir: str) -> dict[str, float]:
    """Loss and accuracy one row at a time, with the model's own forward pass."""
    model = BertForSequenceClassification.from_pretrained(checkpoint_dir).eval()
    ids, labels = token_rows(24, seed=1)
    losses, correct = [], 0
    with torch.no_grad():
        for row, label in zip(ids, labels, strict=True):
            logits = model(input_ids=torch.tensor([row])).logits
            losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor([label])).item())
            correct += int(logits.argmax(-1).item() == label)
    return {"eval_loss": float(np.mean(losses)), "eval_accuracy": correct / len(labels)}


def validate_unless_chosen(checkpoint, config):
    """TransformersValidator, failing on purpose for the report index chosen."""
    if current_validation().report_index == config.get("fail_index"):
        raise RuntimeError("evaluation data unavailable for this checkpoint")
    return TransformersValidator(eval_dataset, batch_size=10)(checkpoint, {})


def training_arguments(output_dir: str, **overrides) -> TrainingArguments:
    options = {
        "max_steps": 6,
        "save_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 8,
        "learning_rate": 5e-3,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    return TrainingArguments(output_dir=output_dir, **options)


# ------------------------------------------------------------------ in Ray Train
def train_in_ray_train(config):
    """Ray's Transformers guide with ckval's callback instead of RayTrainReportCallback."""
    import ray.train
    from ray.train.huggingface.transformers import prepare_trainer

    trainer = Trainer(
        model=tiny_bert(),
        args=training_arguments(config["output_dir"]),
        train_dataset=train_dataset(),
        callbacks=[
            ReportCheckpointCallback(
                validate_fn=validate_unless_chosen,
                validate_config={"fail_index": config["fail_index"]},
            )
        ],
    )
    trainer = prepare_trainer(trainer)
    trainer.train()
    context = ray.train.get_context()
    return {"rank": context.get_world_rank(), "steps": trainer.state.global_step}


@pytest.fixture(scope="module")
def ray_train_run(service, session_home, tmp_path_factory):
    """One 2-worker TorchTrainer run: 3 saves, the second validation fails on purpose."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"hf-ray-train-{os.getpid()}"
    result = TorchTrainer(
        train_in_ray_train,
        train_loop_config={"output_dir": str(tmp_path_factory.mktemp("hf-out")), "fail_index": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(session_home / "ray_results")),
    ).fit()
    with pytest.warns(ValidationsFailedWarning, match="1 of 3 validation"):
        Registry().wait(name, timeout_s=180)
    return name, result


def test_ray_train_reports_each_save_and_validates_it(ray_train_run):
    name, result = ray_train_run
    assert result.error is None  # the failing validation did not stop training
    assert result.return_value == {"rank": 0, "steps": 6}
    registry = Registry()
    records = registry.checkpoints(name)
    assert [(r.report_index, r.step) for r in records] == [(0, 2), (1, 4), (2, 6)]
    assert [r.validation_status for r in records] == ["VALIDATED", "FAILED", "VALIDATED"]
    [failed] = [job for job in registry.validations(name) if job.status == "FAILED"]
    assert failed.error_message == "evaluation data unavailable for this checkpoint"
    for record in records:
        # The Trainer's folder as it saved it, with the logged values of that moment.
        assert {"config.json", "model.safetensors", "trainer_state.json"} <= set(
            os.listdir(record.uri)
        )
        assert record.reported_metrics["step"] == record.step and "loss" in record.reported_metrics
        if record.validation_status == "VALIDATED":
            expected = independent_metrics(record.uri)
            assert record.metrics["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
            assert record.metrics["eval_accuracy"] == expected["eval_accuracy"]


def test_best_model_from_the_registry_loads_with_from_pretrained(ray_train_run):
    name, _ = ray_train_run
    records = {r.report_index: r for r in Registry().checkpoints(name)}
    validated = [r for r in records.values() if r.validation_status == "VALIDATED"]
    best = min(validated, key=lambda r: (r.metrics["eval_loss"], r.report_index))
    model = load_best_model(BertForSequenceClassification, name, "eval_loss", mode="min")
    stored = BertForSequenceClassification.from_pretrained(best.uri)
    for loaded, expected in zip(
        model.state_dict().values(), stored.state_dict().values(), strict=True
    ):
        assert torch.equal(loaded, expected)
    with pytest.raises(LookupError, match="has a metric named 'eval_nothing'.*eval_accuracy"):
        load_best_model(BertForSequenceClassification, name, "eval_nothing")


class WaitForValidation(TrainerCallback):
    """Holds training at one step until the ckval callback has received a validation:
    the next step's hook must then log it, while training goes on."""

    def __init__(self, ckval_callback, at_step: int):
        self.ckval_callback, self.at_step = ckval_callback, at_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            deadline = time.monotonic() + 120
            while not self.ckval_callback.received:
                assert time.monotonic() < deadline, "no validation arrived within 120 s"
                time.sleep(0.05)


def test_plain_script_logs_validated_metrics_while_training_and_resumes(
    ray_train_run, service, unique_run, tmp_path
):
    """Outside Ray Train (run=...), resuming from the Ray Train run's latest checkpoint."""
    name, _ = ray_train_run
    registry = Registry()
    latest = registry.latest_checkpoint(name)
    callback = ReportCheckpointCallback(
        validate_fn=TransformersValidator(eval_dataset(), batch_size=10),
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        run=unique_run,
        poll_interval_s=0.1,
    )
    trainer = Trainer(
        model=tiny_bert(),
        args=training_arguments(str(tmp_path / "out"), max_steps=12, save_total_limit=1),
        train_dataset=train_dataset(),
        callbacks=[callback, WaitForValidation(callback, at_step=9)],
    )
    with latest.as_directory() as directory:
        trainer.train(resume_from_checkpoint=directory)
    received = callback.wait(timeout_s=180)

    records = registry.checkpoints(unique_run)
    # Resumed at step 6 of the Ray Train run: the saves of steps 8, 10 and 12 only.
    assert [r.step for r in records] == [8, 10, 12]
    assert [r.validation_status for r in records] == ["VALIDATED"] * 3
    # The run ended with training.
    assert registry.dashboard.run_view(unique_run).record.status == "FINISHED"
    logged = [e for e in trainer.state.log_history if "eval_checkpoint_step" in e]
    assert [e["eval_checkpoint_step"] for e in logged] == [8, 10, 12]
    assert logged[0]["step"] < 12  # arrived and logged while training went on
    for entry, record in zip(logged, records, strict=True):
        expected = independent_metrics(record.uri)
        assert entry["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
        assert entry["eval_accuracy"] == expected["eval_accuracy"]
        assert received[record.report_index] == record.validated_metrics
        # What was logged for one checkpoint is never reported as a later one's metric.
        assert "eval_loss" not in record.reported_metrics


def test_validator_on_a_ray_dataset_with_map_batches_for_a_causal_lm(ray_session, tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    )
    model.save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(3)
    rows = [
        torch.randint(0, 64, (int(n),), generator=generator).tolist()
        for n in torch.randint(2, 9, (15,), generator=generator)
    ]
    dataset = ray.data.from_items([{"input_ids": np.array(row)} for row in rows])

    def exact_match(prediction):
        valid = prediction.label_ids != -100
        return {"tokens": int(valid.sum())}

    validator = TransformersValidator(
        dataset, task="causal-lm", batch_size=4, executor="map_batches", compute_metrics=exact_match
    )
    assert validator.recommended_resources == {"num_cpus": 0}
    metrics = validator(Checkpoint.from_directory(str(tmp_path)), {})
    total_loss = total_correct = tokens = 0
    model.eval()
    with torch.no_grad():
        for row in rows:  # unpadded, one sequence at a time
            ids = torch.tensor([row])
            logits = model(input_ids=ids).logits[0, :-1]
            total_loss += torch.nn.functional.cross_entropy(
                logits, ids[0, 1:], reduction="sum"
            ).item()
            total_correct += int((logits.argmax(-1) == ids[0, 1:]).sum())
            tokens += len(row) - 1
    assert metrics["eval_tokens"] == tokens
    assert metrics["eval_loss"] == pytest.approx(total_loss / tokens, rel=1e-5)
    assert metrics["eval_accuracy"] == total_correct / tokens
    assert metrics["eval_perplexity"] == pytest.approx(np.exp(total_loss / tokens), rel=1e-5)


# ------------------------------------------------------------------ bad input
def test_a_save_without_its_checkpoint_folder_is_refused(unique_run, tmp_path):
    from transformers import TrainerControl, TrainerState

    callback = ReportCheckpointCallback(validate_fn=validate_unless_chosen, run=unique_run)
    state = TrainerState(global_step=3)
    with pytest.raises(
        InvalidInput, match=r"no checkpoint folder .*checkpoint-3: nothing was reported"
    ):
        callback.on_save(training_arguments(str(tmp_path)), state, TrainerControl())
    assert Registry().find_run_id(unique_run) is None


def test_a_validate_fn_that_cannot_be_pickled_is_refused_when_the_callback_is_made(unique_run):
    pending = (step for step in range(3))  # a generator: never picklable

    def holds_a_lock(checkpoint, config):
        return {"next": next(pending)}

    with pytest.raises(InvalidInput, match="cannot be pickled.*Define it at module level"):
        ReportCheckpointCallback(validate_fn=holds_a_lock, run=unique_run)
    with pytest.raises(InvalidInput, match="outside a Ray Train worker needs run="):
        ReportCheckpointCallback(validate_fn=validate_unless_chosen)
    with pytest.raises(InvalidInput, match="takes neither"):
        ReportCheckpointCallback(
            validate_fn=lambda checkpoint: {}, validate_config={"a": 1}, run=unique_run
        )


def test_callbacks_without_their_library_say_what_to_install():
    """Both front doors, in a process where the library's import fails."""
    code = textwrap.dedent(
        """
        import sys
        for name in ("transformers", "lightning", "lightning.pytorch", "pytorch_lightning"):
            sys.modules[name] = None  # their import fails, as when they are not installed
        from trainer_integration import transformers, lightning
        for module in (transformers, lightning):
            try:
                module.ReportCheckpointCallback(run="never")
            except ImportError as exc:
                print("ERROR:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 2, done.stdout
    assert (
        "needs Hugging Face Transformers" in lines[0]
        and 'pip install "ckval[transformers]"' in lines[0]
    )
    assert "needs PyTorch Lightning" in lines[1] and 'pip install "ckval[lightning]"' in lines[1]


def test_example_runs_as_is(service, unique_run, monkeypatch, capsys):
    # In this process, with the session's Ray and service (a subprocess would start its own).
    example = ROOT / "examples" / "transformers_trainer.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--run", unique_run])
    runpy.run_path(str(example), run_name="__main__")
    stdout = capsys.readouterr().out
    registry = Registry()
    records = registry.checkpoints(unique_run)
    assert [r.step for r in records] == [4, 8, 12]
    assert [r.validation_status for r in records] == ["VALIDATED"] * 3
    for record in records:
        line = (
            f"checkpoint of step {record.step}: eval_loss {record.metrics['eval_loss']:.4f}, "
            f"eval_accuracy {record.metrics['eval_accuracy']:.4f}"
        )
        assert line in stdout
    best = registry.best_checkpoint_records(unique_run, "eval_accuracy", "max", k=1)[0]
    assert (
        f"best checkpoint: step {best.step}, eval_accuracy {best.metrics['eval_accuracy']:.4f}"
        in stdout
    )


def constant_accuracy(checkpoint, config):
    return {"eval_accuracy": 0.5}  # never improves after the first: patience decides


class SlowSteps(TrainerCallback):
    """Each step takes a little time, as real ones do, so validations keep up."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.2)


def test_the_run_stop_policy_sets_should_training_stop(service, unique_run, tmp_path):
    """The registry's decision (patience 1: decided on the second save) ends train()
    through control.should_training_stop, some saves later."""
    from validation_service import StopPolicy

    registry = Registry()
    registry.set_stop_policy(unique_run, StopPolicy("eval_accuracy", patience=1))
    callback = ReportCheckpointCallback(validate_fn=constant_accuracy, run=unique_run)
    max_steps = 60
    trainer = Trainer(
        model=tiny_bert(),
        args=training_arguments(
            str(tmp_path / "out"), max_steps=max_steps, save_steps=1, save_total_limit=2
        ),
        train_dataset=train_dataset(),
        callbacks=[SlowSteps(), callback],
    )
    trainer.train()
    decision = registry.stop_decision(unique_run)
    assert (decision.rule, decision.report_index) == ("patience", 1)
    assert 2 <= trainer.state.global_step < max_steps
    callback.wait(timeout_s=120)
    assert len(registry.checkpoints(unique_run)) == trainer.state.global_step
