"""Hugging Face Transformers: a TrainerCallback that reports each saved checkpoint to ckval.

Each save of the ``Trainer`` becomes a ckval report of its ``checkpoint-<step>`` folder
with the validate_fn given, validated elsewhere while training goes on; the validated
metrics come back into ``trainer.state.log_history`` (and the Trainer's loggers) as
``eval_*`` entries when they arrive. Extra: ``pip install "ckval[transformers]"``.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from trainer_integration import CheckpointUploadMode
from trainer_integration._callbacks import (
    Validated,
    ValidatedMetricsCallback,
    callback_reporter,
    check_poll_interval,
    numeric_metrics,
)
from trainer_integration._rank_files import is_sharded, take_own_files
from validation_service.errors import InvalidInput

try:
    from transformers import TrainerCallback
except ImportError:  # the callback says what to install when it is made
    TrainerCallback = object  # type: ignore[assignment,misc]

__all__ = ["ReportCheckpointCallback", "load_best_model"]

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "ckval[transformers]" (transformers, accelerate, datasets)'
# Marks the log_history entries the callback adds: they are never reported again as
# metrics of a later checkpoint.
CHECKPOINT_STEP_KEY = "eval_checkpoint_step"


class ReportCheckpointCallback(ValidatedMetricsCallback, TrainerCallback):
    """Reports each checkpoint the Hugging Face ``Trainer`` saves, validated by ckval.

    A drop-in for ``ray.train.huggingface.transformers.RayTrainReportCallback`` that needs
    no evaluation inside training: ``save_strategy`` and ``save_steps`` decide when a
    checkpoint is reported, whatever ``eval_strategy`` is. Each report carries the
    Trainer's latest logged values (as Ray's callback) and its ``checkpoint-<step>``
    folder, validated by ``validate_fn`` on the ckval service while training goes on.

    Inside Ray Train (``TorchTrainer`` + ``prepare_trainer``) the run is the RunConfig
    name: rank 0 reports the folder, the other ranks report without one. Outside Ray
    Train pass ``run="name"``: checkpoints go through ``trainer_integration.Client``,
    and the run ends (FINISHED) with training.

    Validated metrics come back through ``Trainer.log`` at the next step or save after
    they arrive (``eval_``-prefixed, with ``eval_checkpoint_step`` naming the checkpoint
    they belong to), so ``state.log_history`` and the Trainer's loggers (TensorBoard,
    W&B, MLflow) see them; a background thread polls the registry every
    ``poll_interval_s`` and training never waits for it. ``received`` holds every
    validated checkpoint's metrics by report index. After training, ``wait()`` waits for
    the last validations and logs them too.
    """

    def __init__(
        self,
        *,
        validate_fn: Callable[..., dict] | str | None = None,
        validate_config: dict | None = None,
        validation_resources: dict | None = None,
        checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
        max_attempts: int = 3,
        timeout_s: float | None = None,
        run: str | None = None,
        poll_interval_s: float = 2.0,
    ) -> None:
        if TrainerCallback is object:
            raise ImportError(
                f"ReportCheckpointCallback needs Hugging Face Transformers, which is not "
                f"installed here: {INSTALL_HINT}."
            )
        check_poll_interval(poll_interval_s)
        reporter = callback_reporter(locals(), temporary_folders=False)
        self._start_reporting(reporter, poll_interval_s)
        self._trainer: Any = None
        self._state: Any = None

    # -- the TrainerCallback protocol --

    def on_train_begin(self, args, state, control, **kwargs):
        self._trainer = _calling_trainer()
        self._state = state
        if self._chief(state):
            self._feed.start()

    def on_step_end(self, args, state, control, **kwargs):
        self._log_arrived(state)

    def on_save(self, args, state, control, **kwargs):
        self._save(args, state)
        # Every rank asks at each save (rank 0's answer everywhere): the run's policy.
        if self._reporter.should_stop():
            control.should_training_stop = True

    def _save(self, args, state) -> None:
        metrics = _latest_logged(state)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.world_size > 1 and os.path.isdir(folder) and is_sharded(folder):
            self._report_own_files(metrics, folder, args.process_index)
            self._log_arrived(state)
            return
        if not self._chief(state):
            self._reporter.report_metrics(metrics)
            return
        if not os.path.isdir(folder):
            raise InvalidInput(
                f"The Trainer saved at step {state.global_step}, but there is no checkpoint "
                f"folder {folder}: nothing was reported. ReportCheckpointCallback reports "
                "the folder Trainer._save_checkpoint writes (output_dir/checkpoint-<step>); "
                "keep TrainingArguments(output_dir=...) as the Trainer has it, and do not "
                "delete the folder in a callback that runs before this one."
            )
        self._report_folder(metrics, folder)
        self._log_arrived(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._log_arrived(state)
        self._feed.stop()
        if self._chief(state):
            self._reporter.close()

    # -- after training --

    def wait(self, timeout_s: float = 300.0) -> dict[int, dict[str, Any]]:
        """Waits for the run's validations and logs the metrics that came in meanwhile.

        Returns ``received`` (every validated checkpoint's metrics by report index).
        """
        self._log(self._feed.wait(timeout_s), self._state)
        return self.received

    # -- reporting and logging --

    def _report_folder(self, metrics: dict[str, Any], folder: str) -> None:
        if self._reporter.mode is CheckpointUploadMode.ASYNC:
            # The Trainer deletes its older folders (save_total_limit) whenever it likes:
            # the background copy reads hard links that ckval deletes once copied.
            name = os.path.basename(folder)
            staging = tempfile.mkdtemp(prefix=f".ckval-{name}-", dir=os.path.dirname(folder))
            shutil.copytree(folder, staging, copy_function=_link_or_copy, dirs_exist_ok=True)
            self._reporter.report_folder(metrics, staging, owned=True)
            return
        self._reporter.report_folder(metrics, folder, owned=False)

    def _report_own_files(self, metrics: dict[str, Any], folder: str, rank: int) -> None:
        """A sharded save (FSDP's SHARDED_STATE_DICT, DeepSpeed ZeRO), where every rank
        wrote its shards into the step's folder: each rank reports the files it wrote
        (rank 0 also those of no rank: configs, metadata), its part of one checkpoint."""
        name = os.path.basename(folder)
        own = tempfile.mkdtemp(prefix=f".ckval-{name}-rank{rank}-", dir=os.path.dirname(folder))
        if take_own_files(folder, rank, own):
            self._reporter.report_folder(metrics, own, owned=True)
        else:
            shutil.rmtree(own, ignore_errors=True)
            self._reporter.report_metrics(metrics)

    def _chief(self, state) -> bool:
        # Process zero saves the checkpoint folder; in Ray Train it is rank 0.
        return state.is_world_process_zero and self._reporter.chief

    def _log_arrived(self, state) -> None:
        if self._chief(state):
            self._log(self._feed.take(), state)

    def _log(self, arrived: list[Validated], state) -> None:
        for outcome in arrived:
            metrics = numeric_metrics(outcome.metrics)
            if not metrics:
                continue
            logs = {_eval_key(name): value for name, value in metrics.items()}
            if outcome.step is not None:
                logs[CHECKPOINT_STEP_KEY] = outcome.step
            if self._trainer is not None:
                self._trainer.log(logs)
            elif state is not None:  # no Trainer in sight: the history at least
                state.log_history.append({**logs, "step": state.global_step})


def load_best_model(
    model_class: Any,
    run: str,
    metric: str,
    mode: str = "max",
    *,
    registry: Any = None,
    **from_pretrained_kwargs: Any,
) -> Any:
    """``model_class.from_pretrained`` of the run's best checkpoint by a validated metric.

    What ``load_best_model_at_end`` does, chosen from the registry after validation:
    ``load_best_model(AutoModelForSequenceClassification, "my-run", "eval_accuracy")``.
    Raises LookupError when no checkpoint of the run has the metric yet.
    """
    if not hasattr(model_class, "from_pretrained"):
        raise InvalidInput(
            f"model_class must be a Transformers model class with from_pretrained (e.g. "
            f"AutoModelForSequenceClassification), got {model_class!r}."
        )
    if registry is None:
        from validation_service.registry.registry import Registry

        registry = Registry()
    best = registry.best_checkpoints(run, metric, mode=mode, k=1)
    if not best:
        raise LookupError(
            f"No checkpoint of run {run!r} has a finite {metric!r} yet: wait for its "
            f"validations (Registry().wait({run!r})) and check the metric's name."
        )
    checkpoint, _ = best[0]
    with checkpoint.as_directory() as directory:
        return model_class.from_pretrained(directory, **from_pretrained_kwargs)


def _latest_logged(state) -> dict[str, Any]:
    """The latest value of every key the Trainer logged, as Ray's callback reports them,
    leaving out what this callback logged for earlier checkpoints."""
    metrics: dict[str, Any] = {}
    for entry in state.log_history:
        if CHECKPOINT_STEP_KEY not in entry:
            metrics.update(entry)
    metrics.update(step=state.global_step, epoch=state.epoch)
    return {k: v for k, v in metrics.items() if v is not None}


def _eval_key(name: str) -> str:
    return name if name.startswith("eval_") else f"eval_{name}"


def _calling_trainer() -> Any:
    """The Trainer whose callback handler is calling, found on the call stack.

    Transformers hands callbacks the model, optimizer and data loaders but not the
    Trainer, whose ``log()`` is the one way into ``log_history`` and every logger.
    None when no Trainer is calling (the callback then appends to log_history only).
    """
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(10):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
