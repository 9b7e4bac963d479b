"""PyTorch Lightning: a Callback that reports checkpoints to ckval and feeds the validated
metrics back into ``trainer.callback_metrics``, where ``ModelCheckpoint(monitor=...)`` and
``EarlyStopping`` read them. Extra: ``pip install "ckval[lightning]"``.
"""

from __future__ import annotations

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
    plain,
)
from trainer_integration._rank_files import is_sharded, take_own_files
from validation_service.errors import InvalidInput

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError:  # the callback says what to install when it is made
        Callback = object  # type: ignore[assignment,misc]

__all__ = ["CHECKPOINT_NAME", "ReportCheckpointCallback"]

CHECKPOINT_NAME = "checkpoint.ckpt"  # the name Ray Train's Lightning callback uses
INSTALL_HINT = 'pip install "ckval[lightning]"'
# Names in callback_metrics that are the Trainer's: validated values never replace them.
RESERVED_NAMES = frozenset({"epoch", "step"})


class ReportCheckpointCallback(ValidatedMetricsCallback, Callback):
    """Reports a Lightning checkpoint at each training epoch's end (or every N steps).

    A drop-in for ``ray.train.lightning.RayTrainReportCallback``: the checkpoint is
    ``trainer.save_checkpoint("checkpoint.ckpt")`` (called on every rank, as Lightning
    requires), reported with the latest ``trainer.callback_metrics`` plus ``epoch`` and
    ``step``, and validated by ``validate_fn`` on the ckval service while training goes
    on. ``every_n_train_steps=N`` reports every N optimizer steps instead of at epoch
    ends. Inside Ray Train (``RayDDPStrategy``, ``RayLightningEnvironment``,
    ``prepare_trainer``) the run is the RunConfig name and rank 0 reports the folder;
    outside Ray Train pass ``run="name"`` (the run ends with ``fit``).

    Validated metrics are put into ``trainer.callback_metrics`` (as tensors, under the
    names ``validate_fn`` returns) and given to the Trainer's loggers at the next report
    point or epoch end after they arrive, the same on every rank, so that
    ``ModelCheckpoint(monitor="val_acc")`` and ``EarlyStopping("val_acc")`` use them as
    they are. A validated value belongs to the checkpoint it was computed on, which is
    older than the model those callbacks see then; ``Registry().best_checkpoints(run,
    "val_acc")`` ranks the checkpoints themselves. A background thread polls the
    registry every ``poll_interval_s``; training never waits for it.
    """

    def __init__(
        self,
        *,
        every_n_train_steps: int | None = None,
        validate_fn: Callable[..., dict] | str | None = None,
        validate_config: dict | None = None,
        validation_resources: dict | None = None,
        checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
        max_attempts: int = 3,
        timeout_s: float | None = None,
        run: str | None = None,
        poll_interval_s: float = 2.0,
    ) -> None:
        if Callback is object:
            raise ImportError(
                "ReportCheckpointCallback needs PyTorch Lightning, which is not installed "
                f"here: {INSTALL_HINT}."
            )
        super().__init__()
        if every_n_train_steps is not None and (
            not isinstance(every_n_train_steps, int)
            or isinstance(every_n_train_steps, bool)
            or every_n_train_steps < 1
        ):
            raise InvalidInput(
                f"every_n_train_steps must be None (report at each epoch end) or an int "
                f">= 1, got {every_n_train_steps!r}."
            )
        check_poll_interval(poll_interval_s)
        self._every_n_train_steps = every_n_train_steps
        reporter = callback_reporter(locals())
        self._start_reporting(reporter, poll_interval_s)
        self._fed_names: set[str] = set()
        self._last_reported_step: int | None = None
        self._trainer: Any = None

    # -- the Lightning Callback protocol --

    def on_fit_start(self, trainer, pl_module) -> None:
        self._trainer = trainer
        if self._chief(trainer):
            self._feed.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self._every_n_train_steps
        step = trainer.global_step
        if every and step % every == 0 and step != self._last_reported_step:
            self._save_and_report(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._every_n_train_steps is None:
            self._save_and_report(trainer)
        else:
            self._feed_metrics(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._feed_metrics(trainer)
        self._feed.stop()
        if self._chief(trainer):
            self._reporter.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._feed.stop()
        if self._chief(trainer):
            self._reporter.close(failed=True)

    # -- after training --

    def wait(self, timeout_s: float = 300.0) -> dict[int, dict[str, Any]]:
        """Waits for the run's validations; their metrics go into callback_metrics.

        Call it on the process that reported (rank 0, or the script). Returns
        ``received`` (every validated checkpoint's metrics by report index).
        """
        arrived = self._feed.wait(timeout_s)
        if self._trainer is not None:
            self._put_into_trainer(self._trainer, arrived)
        return self.received

    # -- reporting --

    def _chief(self, trainer) -> bool:
        return trainer.is_global_zero and self._reporter.chief

    def _save_and_report(self, trainer) -> None:
        self._last_reported_step = trainer.global_step
        metrics = {
            name: plain(value)
            for name, value in trainer.callback_metrics.items()
            if name not in self._fed_names  # those belong to earlier checkpoints
        }
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        chief = self._chief(trainer)
        directory = tempfile.mkdtemp(prefix="ckval-lightning-" if chief else "ckval-scratch-")
        path = os.path.join(directory, CHECKPOINT_NAME)
        try:
            # Every rank calls it: a sharded strategy writes each rank's shard (at rank
            # 0's path), others rank 0's file alone.
            trainer.save_checkpoint(path, weights_only=False)
            if chief and not os.path.exists(path):
                raise InvalidInput(
                    f"trainer.save_checkpoint({path!r}) wrote nothing at step "
                    f"{trainer.global_step}: nothing was reported. The Trainer's strategy or "
                    "CheckpointIO plugin must write the checkpoint at the path it is given."
                )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if trainer.world_size > 1:
            directory = self._own_part(trainer, path, directory, chief)
        if directory is not None:
            self._reporter.report_folder(metrics, directory, owned=True)
        else:
            self._reporter.report_metrics(metrics)
        self._feed_metrics(trainer)
        # Every rank asks at each report (rank 0's answer everywhere): the run's policy.
        if self._reporter.should_stop():
            trainer.should_stop = True

    def _own_part(self, trainer, path: str, directory: str, chief: bool) -> str | None:
        """The folder this rank reports: for a sharded save (FSDPStrategy(state_dict_type=
        "sharded"), where every rank writes its shard at rank 0's path) this rank's own
        files, as its part of the checkpoint; for a whole one rank 0's folder alone.
        Every rank calls it (collectives)."""
        shared = trainer.strategy.broadcast(path, src=0)  # where a sharded save went
        if not (os.path.isdir(shared) and is_sharded(shared)):
            if chief:
                return directory
            shutil.rmtree(directory, ignore_errors=True)
            return None
        own = tempfile.mkdtemp(prefix="ckval-lightning-part-")
        taken = take_own_files(shared, trainer.global_rank, os.path.join(own, CHECKPOINT_NAME))
        trainer.strategy.barrier()  # every rank has its files before rank 0's folder goes
        shutil.rmtree(directory, ignore_errors=True)
        if taken:
            return own
        shutil.rmtree(own, ignore_errors=True)
        return None

    def _feed_metrics(self, trainer) -> None:
        """Puts the validations that arrived into callback_metrics, the same on every rank
        (rank 0 polls; the others get its list: a collective call on every rank)."""
        arrived = self._feed.take() if self._chief(trainer) else None
        if trainer.world_size > 1:
            arrived = trainer.strategy.broadcast(arrived, src=0)
        self._put_into_trainer(trainer, arrived or [])

    def _put_into_trainer(self, trainer, arrived: list[Validated]) -> None:
        import torch

        for outcome in arrived:
            metrics = numeric_metrics(outcome.metrics)
            for name in RESERVED_NAMES.intersection(metrics):
                del metrics[name]  # the Trainer's own, which ModelCheckpoint reads as such
            if not metrics:
                continue
            for name, value in metrics.items():
                trainer.callback_metrics[name] = torch.tensor(value)
            self._fed_names.update(metrics)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
