"""A Hugging Face Trainer script with ckval: each saved checkpoint is evaluated elsewhere.

python examples/transformers_trainer.py [--steps 12] [--run transformers-example]

Training never stops to evaluate: every save (save_steps) is reported to ckval, scored by
TransformersValidator in a Ray task, and the scores come back into the Trainer's log as
eval_* entries. A tiny BERT built from a config learns a toy task (is the first token in
the upper half of the vocabulary?); nothing is downloaded. Inside Ray Train, the same
callback goes into the train function (see docs/transformers.md).
"""

import argparse
import logging
import tempfile

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from trainer_integration.transformers import ReportCheckpointCallback, load_best_model
from validation_service.validators.transformers import TransformersValidator

SEQUENCE = 8


def toy_dataset(rows: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (rows, SEQUENCE), generator=generator)
    labels = (ids[:, 0] >= 32).long()
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--run", default="transformers-example")
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            num_labels=2,
        )
    )
    callback = ReportCheckpointCallback(
        validate_fn=TransformersValidator(toy_dataset(64, seed=1)),  # eval_loss, eval_accuracy
        run=args.run,
    )
    arguments = {
        "max_steps": args.steps,
        "save_steps": 4,
        "save_total_limit": 2,
        "learning_rate": 5e-3,
        "per_device_train_batch_size": 16,
        "logging_steps": 4,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    # The Trainer's folder is scratch: ckval keeps a copy of every checkpoint it reports.
    with tempfile.TemporaryDirectory(prefix="transformers-example-") as output_dir:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(output_dir=output_dir, **arguments),
            train_dataset=toy_dataset(256, seed=0),
            callbacks=[callback],
        )
        trainer.train()
    callback.wait(timeout_s=300)  # the last validations, logged as they come
    for entry in trainer.state.log_history:
        if "eval_checkpoint_step" in entry:
            print(
                f"checkpoint of step {entry['eval_checkpoint_step']}: eval_loss "
                f"{entry['eval_loss']:.4f}, eval_accuracy {entry['eval_accuracy']:.4f}"
            )
    best = load_best_model(BertForSequenceClassification, args.run, "eval_accuracy")
    [(_, metrics)] = callback.best_checkpoints("eval_accuracy", k=1)
    print(
        f"best checkpoint: step {metrics['step']}, eval_accuracy {metrics['eval_accuracy']:.4f}"
        f" ({sum(p.numel() for p in best.parameters())} parameters loaded)"
    )


if __name__ == "__main__":
    main()
