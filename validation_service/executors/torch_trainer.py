"""TorchTrainerValidator: a validate_fn that scores a checkpoint with an eval-only TorchTrainer."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import ray
from ray.train import DataConfig, RunConfig, ScalingConfig, UserCallback

from validation_service.errors import CkvalError, InvalidInput, PermanentValidationError
from validation_service.executors.map_batches import (
    DatasetSource,
    check_dataset_source,
    portable_dataset,
    resolve_dataset,
)

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = ["EvalRunFailed", "ExactSplitDataConfig", "TorchTrainerValidator"]

_CHECKPOINT_DIR = re.compile(r"checkpoint_(\d+)")


class EvalRunFailed(CkvalError, RuntimeError):
    """The eval-only TorchTrainer run of a validation failed (the attempt is retried)."""

    def __init__(self, run_name: str, storage_path: str, checkpoint_path: str, cause: str):
        self.run_name = run_name
        super().__init__(
            f"The eval-only TorchTrainer run {run_name!r} validating checkpoint "
            f"{checkpoint_path} failed: {cause}. The worker tracebacks follow; the run's "
            f"files are under {storage_path}/{run_name}."
        )


@dataclasses.dataclass
class TorchTrainerValidator:
    """Validates a checkpoint with an eval-only ``TorchTrainer`` (Ray's guide), as a validate_fn.

    Each call fits ``TorchTrainer(eval_loop_per_worker, scaling_config=..., datasets=...)``
    with ``train_loop_config = {**eval_config, **validate_config, "checkpoint": checkpoint}``.
    The eval loop computes metrics across workers (torchmetrics syncs through the
    process group Ray Train sets up: gloo on CPU, NCCL on GPU) and either returns them
    (Ray's guide: ``return {"loss": ...}``, read from ``result.return_value``) or reports
    them with ``ray.train.report(metrics)``; the validator returns rank 0's last reported
    metrics updated with its returned dict.

    ``datasets`` values are Datasets or zero-argument functions building them, and travel
    as in MapBatchesValidator. By default every dataset is split across workers without
    dropping rows (``ExactSplitDataConfig``), so metrics cover each row exactly once.

    The run is named ``<training run>-validate-<report index>`` (from the checkpoint's
    storage folder; a unique name where that is unknown) and stored under
    ``run_config.storage_path``, by default ``$CKVAL_HOME/ray_results``. Other
    ``run_config`` fields are kept; its name is replaced.

    The Ray task calling the validator only waits for the trainer's workers: report it
    with ``validation_resources=validator.recommended_resources`` (no CPU), or waiting
    tasks can hold every CPU that their trainers' workers need and never finish.
    """

    eval_loop_per_worker: Callable[[dict[str, Any]], dict[str, Any] | None]
    _: dataclasses.KW_ONLY
    scaling_config: ScalingConfig
    datasets: dict[str, DatasetSource] | None = None
    eval_config: dict[str, Any] | None = None
    run_config: RunConfig | None = None
    dataset_config: DataConfig | None = None

    def __post_init__(self) -> None:
        if not callable(self.eval_loop_per_worker):
            raise InvalidInput(
                f"eval_loop_per_worker must be a function (config) -> dict | None, got "
                f"{self.eval_loop_per_worker!r}."
            )
        if not isinstance(self.scaling_config, ScalingConfig):
            raise InvalidInput(
                f"scaling_config must be a ray.train.ScalingConfig, got {self.scaling_config!r}."
            )
        for name, source in (self.datasets or {}).items():
            check_dataset_source(source, f"datasets[{name!r}]")
        if "checkpoint" in (self.eval_config or {}):
            raise InvalidInput(
                "eval_config must not have a 'checkpoint' key: the eval loop gets the "
                "checkpoint being validated as config['checkpoint']."
            )

    @property
    def recommended_resources(self) -> dict[str, Any]:
        """validation_resources for report(): the calling task needs no CPU of its own.

        An accelerator type is kept so that the job counts against that pool.
        """
        resources: dict[str, Any] = {"num_cpus": 0}
        if self.scaling_config.accelerator_type:
            resources["accelerator_type"] = self.scaling_config.accelerator_type
        return resources

    def __call__(self, checkpoint: Checkpoint, config: dict[str, Any]) -> dict[str, Any]:
        from ray.train.torch import TorchTrainer

        base = self.run_config or RunConfig(storage_path=str(_default_storage_path()))
        name = validation_run_name(checkpoint)
        reported = _Rank0Metrics.remote()
        try:
            run_config = dataclasses.replace(
                base, name=name, callbacks=[*base.callbacks, _CaptureRank0Metrics(reported)]
            )
            trainer = TorchTrainer(
                self.eval_loop_per_worker,
                train_loop_config={
                    **(self.eval_config or {}),
                    **(config or {}),
                    "checkpoint": checkpoint,
                },
                scaling_config=self.scaling_config,
                run_config=run_config,
                datasets={
                    key: resolve_dataset(source, f"datasets[{key!r}]")
                    for key, source in (self.datasets or {}).items()
                },
                dataset_config=self.dataset_config or ExactSplitDataConfig(),
            )
            try:
                result = trainer.fit()
            except ray.train.TrainingFailedError as exc:
                lines = str(exc).strip().splitlines()
                raise EvalRunFailed(
                    name, str(base.storage_path), checkpoint.path, lines[-1] if lines else repr(exc)
                ) from exc
            metrics = dict(ray.get(reported.get.remote()) or {})
        finally:
            ray.kill(reported)
        if isinstance(result.return_value, dict):
            metrics.update(result.return_value)
        elif result.return_value is not None:
            raise PermanentValidationError(
                f"the eval loop {_name(self.eval_loop_per_worker)} returned "
                f"{type(result.return_value).__name__} on rank 0; return a dict of metrics "
                "or None (and call ray.train.report(metrics))."
            )
        if not metrics:
            raise PermanentValidationError(
                f"the eval loop {_name(self.eval_loop_per_worker)} of run {name!r} neither "
                "returned a dict of metrics on rank 0 nor called ray.train.report(metrics)."
            )
        return metrics

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.datasets:
            state["datasets"] = {
                key: portable_dataset(source, f"datasets[{key!r}]")
                for key, source in self.datasets.items()
            }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class ExactSplitDataConfig(DataConfig):
    """Splits each dataset across workers without dropping rows (Ray's default equalizes).

    Ray Train's DataConfig gives every worker the same number of rows, dropping up to
    ``num_workers - 1`` of them; a validation metric must see every row once.
    """

    def configure(
        self,
        datasets: dict[str, ray.data.Dataset],
        world_size: int,
        worker_handles: list | None,
        worker_node_ids: list | None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        to_split = (
            set(datasets) if self._datasets_to_split == "all" else set(self._datasets_to_split)
        )
        hints = worker_node_ids if self._enable_shard_locality else None
        for name, dataset in datasets.items():
            if dataset.name is None:
                dataset.set_name(name)
            dataset = dataset.copy(dataset)
            dataset.context.execution_options = self._resolve_execution_options(name)
            if name in to_split:
                splits = dataset.streaming_split(world_size, equal=False, locality_hints=hints)
                for rank, split in enumerate(splits):
                    output[rank][name] = split
            else:
                for rank in range(world_size):
                    output[rank][name] = dataset.iterator()
        return output


def validation_run_name(checkpoint: Checkpoint) -> str:
    """``<training run>-validate-<report index>`` for a checkpoint in ckval's storage layout.

    ckval stores checkpoints as ``.../<run>/checkpoint_<report index>``; a checkpoint
    elsewhere (e.g. a downloaded copy) gets a unique name from its folder.
    """
    path = PurePosixPath(checkpoint.path)
    match = _CHECKPOINT_DIR.fullmatch(path.name)
    if match and path.parent.name:
        return f"{path.parent.name}-validate-{int(match.group(1))}"
    return f"ckval-validate-{path.name}-{uuid.uuid4().hex[:8]}"


@ray.remote(num_cpus=0)
class _Rank0Metrics:
    """Holds the metrics rank 0 last reported; the callback runs in Ray Train's controller."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] | None = None

    def put(self, metrics: dict[str, Any]) -> None:
        self.metrics = metrics

    def get(self) -> dict[str, Any] | None:
        return self.metrics


class _CaptureRank0Metrics(UserCallback):
    # Ray Train 2.60 keeps metrics reported without a checkpoint out of Result.metrics.
    def __init__(self, mailbox: ray.actor.ActorHandle):
        self.mailbox = mailbox

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if metrics and metrics[0]:
            ray.get(self.mailbox.put.remote(dict(metrics[0])))


def _default_storage_path():
    from validation_service.config import get_settings

    return get_settings().resolved_home() / "ray_results"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
