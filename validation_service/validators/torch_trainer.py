"""TorchTrainerValidator: a validate_fn that scores a checkpoint with an eval-only TorchTrainer."""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import ray
from ray.train import DataConfig, RunConfig, ScalingConfig, UserCallback

from validation_service import _ray_compat
from validation_service.context import current_validation
from validation_service.errors import CkvalError, InvalidInput, PermanentValidationError
from validation_service.metrics import to_plain
from validation_service.validators.map_batches import (
    DatasetSource,
    check_dataset_source,
    portable_dataset,
    resolve_dataset,
)

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = ["EvalRunFailed", "ExactSplitDataConfig", "TorchTrainerValidator"]

_CHECKPOINT_DIR = re.compile(r"checkpoint_(\d+)")
# Rank 0's last reported metrics, written by the run's controller into the run's folder.
EVAL_METRICS_FILE = "ckval_eval_metrics.json"
# Rank 0's return value, written by the eval loop itself where Ray has no Result.return_value.
EVAL_RETURN_FILE = "ckval_eval_return.json"


class EvalRunFailed(CkvalError, RuntimeError):
    """The eval-only TorchTrainer run of a validation failed (the attempt is retried)."""

    def __init__(self, run_name: str, storage_path: str, checkpoint_path: str, cause: str):
        self.run_name = run_name
        super().__init__(
            f"The eval-only TorchTrainer run {run_name!r} validating checkpoint "
            f"{checkpoint_path} failed: {cause}. The job's traceback has each worker's "
            f"error; the run's files are under {storage_path}/{run_name}."
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

    Inside a ckval validation the workers get the checkpoint where it is stored (S3 or
    any fsspec URI, read through ``Checkpoint.as_directory()``), so that workers on other
    nodes can read it; local storage must then be a folder every node mounts.

    The run is named ``<training run>-validate-<report index>`` (``validation_run_name``)
    and stored under ``run_config.storage_path``, by default ``$CKVAL_HOME/ray_results``.
    Other ``run_config`` fields are kept; its name is replaced.

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
        run_config = dataclasses.replace(
            base, name=name, callbacks=[*base.callbacks, _SaveRank0Metrics()]
        )
        _delete_saved_metrics(run_config)  # left by an earlier attempt of the same validation
        context = current_validation()
        if context is not None:
            # The eval run's workers may be on other nodes: with remote storage the
            # checkpoint passed in is a verified copy on this node; they read the stored one.
            checkpoint = context.stored_checkpoint()
        eval_loop = self.eval_loop_per_worker
        if not _ray_compat.result_has_return_value():  # Ray 2.51-2.55
            eval_loop = _SaveRank0Return(eval_loop, run_config.storage_context)
        trainer = TorchTrainer(
            eval_loop,
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
        metrics = _load_saved_metrics(run_config)
        returned = getattr(result, "return_value", None) or _load_saved_return(run_config)
        if isinstance(returned, dict):
            metrics.update(returned)
        elif returned is not None:
            raise PermanentValidationError(
                f"the eval loop {_name(self.eval_loop_per_worker)} returned "
                f"{_returned_type(returned)} on rank 0; return a dict of metrics "
                "or None (and call ray.train.report(metrics))."
            )
        if not metrics:
            raise PermanentValidationError(
                f"the eval loop {_name(self.eval_loop_per_worker)} of run {name!r} neither "
                "returned a dict of metrics on rank 0 nor called ray.train.report(metrics)."
            )
        return metrics

    def __getstate__(self) -> dict[str, Any]:
        datasets = self.datasets and {
            key: portable_dataset(source, f"datasets[{key!r}]")
            for key, source in self.datasets.items()
        }
        return {**self.__dict__, "datasets": datasets}


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
            dataset.context.execution_options = _ray_compat.data_execution_options(self, name)
            if name in to_split:
                splits = dataset.streaming_split(world_size, equal=False, locality_hints=hints)
                for rank, split in enumerate(splits):
                    output[rank][name] = split
            else:
                for rank in range(world_size):
                    output[rank][name] = dataset.iterator()
        return output


def validation_run_name(checkpoint: Checkpoint) -> str:
    """``<training run>-validate-<report index>``: the validation's own name for its run.

    Taken from the running validation (``current_validation()``), else from ckval's
    storage layout ``.../<run>/checkpoint_<report index>``; a checkpoint elsewhere gets a
    unique name from its folder.
    """
    context = current_validation()
    if context is not None:
        return f"{context.run}-validate-{context.report_index}"
    path = PurePosixPath(checkpoint.path)
    match = _CHECKPOINT_DIR.fullmatch(path.name)
    if match and path.parent.name:
        return f"{path.parent.name}-validate-{int(match.group(1))}"
    return f"ckval-validate-{path.name}-{uuid.uuid4().hex[:8]}"


class _SaveRank0Metrics(UserCallback):
    """Saves rank 0's last ``ray.train.report(metrics)`` next to the run's files.

    Ray Train 2.60 keeps metrics reported without a checkpoint out of ``Result.metrics``,
    and this callback runs in the run's controller, not in the validator's process.
    """

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or not metrics[0]:
            return
        storage = run_context.run_config.storage_context
        storage.storage_filesystem.create_dir(storage.experiment_fs_path, recursive=True)
        payload = json.dumps(to_plain(dict(metrics[0]))).encode()
        with storage.storage_filesystem.open_output_stream(_metrics_path(storage)) as out:
            out.write(payload)


def _metrics_path(storage) -> str:
    return posixpath.join(storage.experiment_fs_path, EVAL_METRICS_FILE)


@dataclasses.dataclass
class _SaveRank0Return:
    """The eval loop, saving what it returns on rank 0 next to the run's files: Ray
    2.51-2.55 have no ``Result.return_value`` to carry it to the validator."""

    eval_loop: Callable[[dict[str, Any]], Any]
    storage: Any  # the run's StorageContext

    def __call__(self, config: dict[str, Any]) -> Any:
        returned = self.eval_loop(config)
        if returned is not None and ray.train.get_context().get_world_rank() == 0:
            if isinstance(returned, dict):
                saved = {"metrics": to_plain(dict(returned))}
            else:
                saved = {"type": type(returned).__name__}
            fs = self.storage.storage_filesystem
            fs.create_dir(self.storage.experiment_fs_path, recursive=True)
            with fs.open_output_stream(_return_path(self.storage)) as out:
                out.write(json.dumps(saved).encode())
        return returned


def _return_path(storage) -> str:
    return posixpath.join(storage.experiment_fs_path, EVAL_RETURN_FILE)


def _load_saved_return(run_config: RunConfig) -> dict[str, Any] | _ReturnedType | None:
    storage = run_config.storage_context
    try:
        with storage.storage_filesystem.open_input_stream(_return_path(storage)) as f:
            saved = json.loads(f.read().decode())
    except FileNotFoundError:
        return None
    return saved["metrics"] if "metrics" in saved else _ReturnedType(saved["type"])


@dataclasses.dataclass(frozen=True)
class _ReturnedType:
    """What a rank 0 eval loop returned that is not a dict (on Ray 2.51-2.55): its type."""

    name: str


def _returned_type(returned: Any) -> str:
    return returned.name if isinstance(returned, _ReturnedType) else type(returned).__name__


def _load_saved_metrics(run_config: RunConfig) -> dict[str, Any]:
    storage = run_config.storage_context
    try:
        with storage.storage_filesystem.open_input_stream(_metrics_path(storage)) as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return {}


def _delete_saved_metrics(run_config: RunConfig) -> None:
    storage = run_config.storage_context
    for path in (_metrics_path(storage), _return_path(storage)):
        try:
            storage.storage_filesystem.delete_file(path)
        except FileNotFoundError:
            pass


def _default_storage_path():
    from validation_service.config import get_settings

    return get_settings().resolved_home() / "ray_results"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
