"""TransformersValidator: loss and accuracy of a Hugging Face checkpoint on held-out data.

A validate_fn for the folders ``trainer_integration.transformers.ReportCheckpointCallback``
reports (``config.json`` + weights): a sequence-classification or causal-LM model scored
on a ``datasets.Dataset`` or a Ray Dataset, in the validation's Ray task or as a Ray Data
``map_batches`` job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from validation_service.errors import InvalidInput, PermanentValidationError
from validation_service.validators.map_batches import (
    _actor_pool,
    actor_resources,
    portable_dataset,
)

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = ["TransformersValidator"]

TASKS = ("sequence-classification", "causal-lm")
EXECUTORS = ("task", "map_batches")
IGNORE_INDEX = -100  # the label Transformers' losses skip
_SUMS = ("loss_sum", "correct", "count")


@dataclasses.dataclass
class TransformersValidator:
    """Scores a Transformers checkpoint: ``<prefix>_loss`` and ``<prefix>_accuracy``.

    ``task="sequence-classification"``: the mean cross-entropy over rows and the share of
    rows whose arg-max logit is the label (column ``labels``, or ``label``).
    ``task="causal-lm"``: the mean next-token cross-entropy over every predicted token
    (labels are ``labels`` if the dataset has them, else ``input_ids``; -100 and padding
    are skipped), the share of tokens predicted right, and ``<prefix>_perplexity``. Sums
    are taken in float64 over the whole dataset, so the values do not depend on batching.

    ``dataset`` is a ``datasets.Dataset`` or a ``ray.data.Dataset`` with an ``input_ids``
    column (rows of token ids, any lengths: batches are right-padded with
    ``pad_token_id``, default the model's, else 0) and optionally ``attention_mask``; or a
    zero-argument function returning one, called where the validation runs. It travels
    inside the pickled validator, as in MapBatchesValidator.

    ``compute_metrics`` is the Trainer's: it gets an ``EvalPrediction`` (logits for
    sequence classification, predicted token ids for causal LM; label ids) and its dict is
    added under ``<prefix>_`` (``metric_key_prefix="eval"``, as ``Trainer.evaluate``).

    ``executor="task"`` runs the model in the validation's own Ray task;
    ``executor="map_batches"`` runs ``concurrency`` map_batches actors (each with
    ``num_cpus``, ``num_gpus``, ``accelerator_type``). Report with
    ``validation_resources=validator.recommended_resources``.
    """

    dataset: Any
    _: dataclasses.KW_ONLY
    task: str = "sequence-classification"
    batch_size: int = 32
    compute_metrics: Callable[[Any], dict[str, Any]] | None = None
    metric_key_prefix: str = "eval"
    executor: str = "task"
    concurrency: int | tuple[int, int] = 1
    num_cpus: float | None = None
    num_gpus: float = 0
    accelerator_type: str | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {self.task!r}.")
        if self.executor not in EXECUTORS:
            raise InvalidInput(f"executor must be one of {EXECUTORS}, got {self.executor!r}.")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InvalidInput(f"batch_size must be an int >= 1, got {self.batch_size!r}.")
        if self.compute_metrics is not None and not callable(self.compute_metrics):
            raise InvalidInput(
                "compute_metrics must be a function (EvalPrediction) -> dict, as the "
                f"Trainer's, got {self.compute_metrics!r}."
            )
        if not isinstance(self.metric_key_prefix, str):
            raise InvalidInput(f"metric_key_prefix must be a str, got {self.metric_key_prefix!r}")
        if not (callable(self.dataset) or _is_hf_dataset(self.dataset) or _is_ray(self.dataset)):
            raise InvalidInput(
                "dataset must be a datasets.Dataset, a ray.data.Dataset, or a zero-argument "
                f"function returning one, got {type(self.dataset).__name__}."
            )
        if self.executor == "map_batches":
            _actor_pool(self.concurrency)  # fails now, not at validation time

    @property
    def recommended_resources(self) -> dict[str, Any]:
        """validation_resources for report(): the model's in the task, none for map_batches."""
        resources: dict[str, Any] = {"num_cpus": 0 if self.executor == "map_batches" else 1}
        if self.executor == "task" and self.num_gpus:
            resources["num_gpus"] = self.num_gpus
        if self.accelerator_type:
            resources["accelerator_type"] = self.accelerator_type
        return resources

    def __call__(self, checkpoint: Checkpoint, config: dict[str, Any]) -> dict[str, Any]:
        dataset = self._resolved_dataset()
        if self.executor == "task":
            with checkpoint.as_directory() as directory:
                scorer = BatchScorer(directory, self.task, self.pad_token_id)
                scored = [scorer(batch) for batch in _batches(dataset, self.batch_size)]
        else:
            scored = self._score_with_map_batches(dataset, checkpoint)
        return self._metrics(scored)

    def __getstate__(self) -> dict[str, Any]:
        dataset = self.dataset
        if _is_ray(dataset):
            dataset = portable_dataset(dataset, "dataset")
        return {**self.__dict__, "dataset": dataset}

    # ------------------------------------------------------------------ internals
    def _resolved_dataset(self) -> Any:
        dataset = self.dataset
        if callable(dataset) and not (_is_hf_dataset(dataset) or _is_ray(dataset)):
            dataset = dataset()
        if not (_is_hf_dataset(dataset) or _is_ray(dataset)):
            raise PermanentValidationError(
                f"dataset: the function returned {type(dataset).__name__}, not a "
                "datasets.Dataset or a ray.data.Dataset."
            )
        return dataset

    def _score_with_map_batches(self, dataset: Any, checkpoint: Checkpoint) -> list[dict]:
        import ray.data

        if _is_hf_dataset(dataset):
            dataset = ray.data.from_huggingface(dataset)
        options = actor_resources(self.num_cpus, self.num_gpus, self.accelerator_type)
        output = dataset.map_batches(
            _MapBatchesScorer,
            fn_constructor_kwargs={
                "checkpoint": checkpoint,
                "task": self.task,
                "pad_token_id": self.pad_token_id,
            },
            batch_size=self.batch_size,
            batch_format="numpy",
            compute=_actor_pool(self.concurrency),
            **options,
        )
        return list(output.iter_batches(batch_size=None, batch_format="numpy"))

    def _metrics(self, scored: list[dict[str, Any]]) -> dict[str, Any]:
        sums = {
            name: sum(float(np.sum(b[name], dtype=np.float64)) for b in scored) for name in _SUMS
        }
        if sums["count"] == 0:
            raise PermanentValidationError(
                "the validation dataset has no rows (or, for causal LM, no token to predict)."
            )
        loss = sums["loss_sum"] / sums["count"]
        metrics = {"loss": loss, "accuracy": sums["correct"] / sums["count"]}
        if self.task == "causal-lm":
            metrics["perplexity"] = math.exp(loss) if loss < 700 else math.inf
        if self.compute_metrics is not None:
            from transformers import EvalPrediction

            predictions = _stacked([row for b in scored for row in b["prediction"]], 0)
            labels = _stacked([row for b in scored for row in b["label"]], IGNORE_INDEX)
            extra = self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=labels))
            if not isinstance(extra, dict):
                raise PermanentValidationError(
                    f"compute_metrics returned {type(extra).__name__}; it must return a dict."
                )
            metrics.update(extra)
        prefix = f"{self.metric_key_prefix}_" if self.metric_key_prefix else ""
        return {
            name if name.startswith(prefix) else prefix + name: value
            for name, value in metrics.items()
        }


class BatchScorer:
    """A loaded model that turns a batch of rows into per-row sums (and predictions)."""

    def __init__(self, directory: str, task: str, pad_token_id: int | None) -> None:
        import torch
        import transformers

        model_class = (
            transformers.AutoModelForSequenceClassification
            if task == "sequence-classification"
            else transformers.AutoModelForCausalLM
        )
        try:
            self.model = model_class.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise PermanentValidationError(
                f"{model_class.__name__}.from_pretrained could not load the checkpoint "
                f"({exc}). Report the folder the Trainer saves (config.json and the "
                "weights), e.g. with trainer_integration.transformers.ReportCheckpointCallback."
            ) from None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device).eval()
        self.task = task
        configured = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (configured or 0)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        if "input_ids" not in batch:
            raise PermanentValidationError(
                f"the validation dataset has no input_ids column (columns: {sorted(batch)})."
            )
        input_ids = _padded(batch["input_ids"], self.pad_token_id)
        mask = (
            _padded(batch["attention_mask"], 0)
            if "attention_mask" in batch
            else (_padded(batch["input_ids"], -1) != -1).long()
        )
        with torch.no_grad():
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits.float()
        if self.task == "sequence-classification":
            return _classification_sums(logits.cpu(), _labels_of(batch))
        labels = input_ids
        if "labels" in batch:
            if np.asarray(batch["labels"]).dtype != object and np.ndim(batch["labels"]) < 2:
                raise PermanentValidationError(
                    "causal-lm takes token ids as labels (one sequence per row, or no "
                    "labels column: then input_ids); this dataset's labels column holds one "
                    "value per row. Drop it, or use task='sequence-classification'."
                )
            labels = _padded(batch["labels"], IGNORE_INDEX)
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        return _next_token_sums(logits.cpu(), labels)


class _MapBatchesScorer(BatchScorer):
    """BatchScorer as a map_batches actor: loads the checkpoint once per actor."""

    def __init__(self, checkpoint: Checkpoint, task: str, pad_token_id: int | None) -> None:
        with checkpoint.as_directory() as directory:
            super().__init__(directory, task, pad_token_id)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        scored = super().__call__(batch)
        # Rows of predictions may differ in length from batch to batch: one object each.
        for name in ("prediction", "label"):
            rows = np.empty(len(scored[name]), dtype=object)
            rows[:] = list(scored[name])
            scored[name] = rows
        return scored


def _classification_sums(logits, labels) -> dict[str, Any]:
    import torch

    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return {
        "loss_sum": losses.double().numpy(),
        "correct": (logits.argmax(dim=-1) == labels).numpy().astype(np.int64),
        "count": np.ones(len(labels), dtype=np.int64),
        "prediction": logits.numpy(),
        "label": labels.numpy(),
    }


def _next_token_sums(logits, labels) -> dict[str, Any]:
    import torch

    logits, labels = logits[:, :-1, :], labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    valid = labels != IGNORE_INDEX
    predicted = logits.argmax(dim=-1)
    return {
        "loss_sum": (losses.double() * valid).sum(dim=1).numpy(),
        "correct": ((predicted == labels) & valid).sum(dim=1).numpy(),
        "count": valid.sum(dim=1).numpy(),
        "prediction": predicted.numpy(),
        "label": labels.numpy(),
    }


def _labels_of(batch: dict[str, Any]):
    import torch

    for name in ("labels", "label"):
        if name in batch:
            return torch.as_tensor(np.asarray(batch[name], dtype=np.int64))
    raise PermanentValidationError(
        "sequence classification needs a labels (or label) column in the validation "
        f"dataset; its columns are {sorted(batch)}."
    )


def _padded(rows: Any, pad_value: int):
    """A (rows, longest) LongTensor of sequences of any lengths, right-padded."""
    import torch

    sequences = [np.asarray(row, dtype=np.int64).reshape(-1) for row in rows]
    longest = max((len(s) for s in sequences), default=0)
    out = np.full((len(sequences), longest), pad_value, dtype=np.int64)
    for i, sequence in enumerate(sequences):
        out[i, : len(sequence)] = sequence
    return torch.from_numpy(out)


def _stacked(rows: list[np.ndarray], pad_value: float) -> np.ndarray:
    """Rows of equal rank stacked, the shorter ones padded (for compute_metrics)."""
    if not rows:
        return np.empty((0,))
    rows = [np.asarray(row) for row in rows]
    if rows[0].ndim == 0 or all(row.shape == rows[0].shape for row in rows):
        return np.stack(rows)
    longest = max(row.shape[0] for row in rows)
    out = np.full((len(rows), longest, *rows[0].shape[1:]), pad_value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


def _batches(dataset: Any, batch_size: int) -> Iterator[dict[str, Any]]:
    if _is_ray(dataset):
        yield from dataset.iter_batches(batch_size=batch_size, batch_format="numpy")
        return
    for start in range(0, len(dataset), batch_size):
        yield dataset[start : start + batch_size]


def _is_hf_dataset(value: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(value, datasets.Dataset)


def _is_ray(value: Any) -> bool:
    import ray.data

    return isinstance(value, ray.data.Dataset)
