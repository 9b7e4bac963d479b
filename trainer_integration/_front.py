"""report(): checks a report once and sends it where it goes: into the run of a Ray Train
worker (``_ray_train.py``), or into the run that ``start_run()`` named. And what a Ray
Train worker prepares as ckval is imported, before its first report."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from trainer_integration import _client
from trainer_integration._request import CheckpointUploadMode, ReportOptions, prepare_report
from trainer_integration._stopping import attach
from validation_service.errors import InvalidInput

logger = logging.getLogger(__name__)


def report(
    metrics: dict,
    checkpoint=None,
    *,
    validate_fn: Callable[..., dict] | str | None = None,
    validate_config: dict | None = None,
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
    validation_resources: dict | None = None,
    priority: int = 0,
    timeout_s: float | None = None,
    max_attempts: int = 3,
    retry_on_timeout: bool = False,
    coalesce: str | None = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    validation: bool | Any = False,
) -> None:
    """Reports metrics and a checkpoint; its validation runs later, elsewhere.

    Inside a Ray Train worker call it where ``ray.train.report`` would be called, on
    every rank: rank 0 passes the checkpoint and the others ``report({}, None)``, or
    every rank passes its own folder (a sharded save: FSDP, DeepSpeed,
    torch.distributed.checkpoint), and the union of the ranks' files is one checkpoint,
    registered once every rank has reported and stored its part (see
    docs/sharded-checkpoints.md). The checkpoint is copied into ckval's storage and
    registered with its validation enqueued; the same ``ray.train.report`` call, in the
    same upload mode, gives Ray Train a pointer to it, so Ray Train's rank sync, its
    collectives, ``Result.checkpoints`` and a restarted worker's
    ``ray.train.get_checkpoint()`` (the stored model files) work as without ckval. SYNC
    returns once ckval's copy is stored and registered and Ray Train holds the report;
    ASYNC returns at once and copies in the background (keep the folder: it is deleted
    once copied, as Ray Train does, unless ``delete_local_checkpoint_after_upload=False``).
    A checkpoint that cannot be stored fails the run, as Ray Train's failed upload does.
    Outside Ray Train, call ``start_run(name)`` first; there SYNC returns once the
    checkpoint is registered. Returns without waiting for validation.

    ``timeout_s`` bounds one validation attempt (its Ray task is cancelled, the job
    TIMED_OUT, or retried when ``retry_on_timeout``). ``coalesce="latest"`` skips the
    run's queued validations that this report supersedes (recorded as CANCELLED).

    Ray Train's form works too, under this package's ``TorchTrainer`` or
    ``TensorflowTrainer`` built with ``validation_config=ray.train.ValidationConfig(fn)``:
    ``validation=True`` or ``ray.train.ValidationTaskConfig(fn_kwargs=..., timeout_s=...)``
    validates with ``fn(checkpoint, **fn_kwargs)``. Inside Ray Train, a rank's report
    without a checkpoint ignores the validation arguments of either form (no error, no
    job), so every rank may pass them; outside Ray Train a validation without a
    checkpoint is refused.
    """
    options = ReportOptions.of(locals())
    context = _ray_train_context()
    if context is not None and checkpoint is None:
        # A rank that reports no checkpoint validates nothing: every rank may pass the
        # same validation arguments, whichever rank passes the checkpoint.
        options = options.without_validation()
    prepared = prepare_report(metrics, checkpoint, options)
    if context is not None:
        from trainer_integration._ray_train import report_in_ray_train

        report_in_ray_train(context, _reporter_of_run_of, prepared, checkpoint)
    else:
        _report_outside_ray_train(prepared, checkpoint)


def _report_outside_ray_train(prepared, checkpoint) -> None:
    """Into the run of start_run(); SYNC returns once the checkpoint is registered."""
    run = _client.current_run()
    if run is None:
        raise InvalidInput(
            "report() outside a Ray Train worker needs a run: call "
            "trainer_integration.start_run('my-run') first, or use Client('my-run')."
        )
    if checkpoint is None:
        return
    reporter = _client.run_reporter(run)
    attach(run, reporter)  # wakes should_stop()'s watcher after registrations
    if prepared.mode is CheckpointUploadMode.ASYNC:
        # Returns at once: the index is reserved in the background.
        reporter.store_and_register(
            prepared.metrics, checkpoint, prepared.job, delete_local=prepared.delete_local
        )
        return
    reporter.report(prepared, checkpoint)


_client.sign_client_report(report)


def _reporter_of_run_of(context):
    """The reporter of a Ray Train worker's run, followed by its should_stop() watcher."""
    reporter = _client.run_reporter(_client.ray_train_run_name(context))
    attach(reporter.run, reporter)  # wakes should_stop()'s watcher after registrations
    return reporter


def _ray_train_context():
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return None


def set_up_ray_train_worker() -> None:
    """In a Ray Train worker, as ckval is imported (the train function's unpickling):
    a restarted worker's ``ray.train.get_checkpoint()`` gives the stored model files,
    and the run's reporter is set up on a thread while training starts (every rank of a
    group of several, rank 0 alone otherwise: it also starts the service if none runs),
    so that the first report() finds the registry open. It writes nothing; a failure is
    left to the first report() to raise."""
    if "ray.train" not in sys.modules:  # not in a Ray Train worker: nothing to prepare
        return
    from validation_service._ray_compat import worker_train_context

    context = worker_train_context()  # without importing Ray Tune, as ray.train.get_context
    if context is None:
        return
    from trainer_integration._resume import resume_with_model_files

    resume_with_model_files()
    run = context.get_experiment_name()
    if not _client.is_safe_name(run):
        return  # the first report() raises, saying how to rename the run
    threading.Thread(
        target=_set_up, args=(run, context.get_world_rank() == 0), name="ckval-set-up", daemon=True
    ).start()


def _set_up(run: str, with_service: bool) -> None:
    try:
        _client.run_reporter(run).prepare(with_service=with_service)
    except Exception:  # noqa: BLE001 - the first report() sets up again and raises
        logger.debug("early set-up of run %r failed", run, exc_info=True)
