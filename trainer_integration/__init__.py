"""What training code imports: report() with a validate_fn, runs outside Ray Train, clients."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from trainer_integration._reporter import (
    POINTER_FILE,
    CheckpointUploadMode,
    ReportNotDelivered,
    RunReporter,
    build_job_spec,
    plain_metrics,
    pointer_bytes,
    resolve_settings,
)
from validation_service.errors import InvalidInput

__all__ = [
    "CheckpointUploadMode",
    "Client",
    "ReportNotDelivered",
    "report",
    "resolve_checkpoint",
    "start_run",
]

logger = logging.getLogger(__name__)
_reporters: dict[str, RunReporter] = {}
_reporters_lock = threading.Lock()
_current_run: str | None = None


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
) -> None:
    """Reports metrics and a checkpoint; its validation runs later, elsewhere.

    Inside a Ray Train worker call it on every rank, as ``ray.train.report``: rank 0
    passes the checkpoint, the others ``report({}, None)``. The checkpoint is copied
    into ckval's storage, Ray Train gets a pointer checkpoint so ``Result.checkpoints``
    still lists it, and the checkpoint is registered and its validation enqueued on a
    background thread when Ray Train's report returns (or HOLD_REGISTRATION_S after the
    copy, if Ray Train holds the report longer), so that training goes on meanwhile (a
    failure to register is raised by the next report() as ReportNotDelivered). Outside Ray Train,
    call ``start_run(name)`` first; there report() returns once it is registered.
    Returns without waiting for validation.

    ``timeout_s`` bounds one validation attempt (its Ray task is cancelled, the job
    TIMED_OUT, or retried when ``retry_on_timeout``). ``coalesce="latest"`` skips the
    run's queued validations that this report supersedes (recorded as CANCELLED).
    """
    metrics, job = _prepare(
        metrics,
        checkpoint,
        checkpoint_upload_mode,
        validate_fn,
        validate_config,
        validation_resources,
        priority,
        timeout_s,
        max_attempts,
        retry_on_timeout,
        coalesce,
    )
    train_context = _ray_train_context()
    if train_context is None:
        if _current_run is None:
            raise InvalidInput(
                "report() outside a Ray Train worker needs a run: call "
                "trainer_integration.start_run('my-run') first, or use Client('my-run')."
            )
        if checkpoint is not None:
            _reporter(_current_run).report(metrics, checkpoint, job, checkpoint_upload_mode)
        return

    import ray.train

    if checkpoint is None:
        ray.train.report(metrics)
        return
    run = train_context.get_experiment_name()
    storing = None
    try:
        reporter = _reporter(run)
        if checkpoint_upload_mode is CheckpointUploadMode.SYNC:
            # ckval's copy stands in for the one Ray Train would make; it runs while
            # Ray Train syncs the ranks, and Ray Train gets the pointer once it is done.
            index, uri, storing = reporter.start_storing(checkpoint)
        else:
            index, uri = reporter.report(metrics, checkpoint, job, checkpoint_upload_mode)
    except Exception:
        ray.train.report(metrics)  # the other ranks are in this report too: keep in step
        raise
    registering = []
    returned = threading.Event()

    def register_once() -> None:
        # Once the copy is done, the checkpoint is registered (and its validation
        # enqueued) on a background thread: when Ray Train's report returns, so as not
        # to compete with its end, or HOLD_REGISTRATION_S after the copy if Ray Train
        # still holds the report (its result queue is full), so as not to wait for it.
        if storing is not None and not registering:
            registering.append(True)
            reporter.register_in_background(
                index, storing.result(), metrics, job, not_before=returned
            )

    try:
        _report_pointer(reporter, index, uri, metrics, checkpoint, register_once)
    finally:
        returned.set()
        register_once()  # Ray Train skipped the report, or the pointer failed: stored still


def _report_pointer(
    reporter: RunReporter, index: int, uri: str, metrics: dict, checkpoint, stored
) -> None:
    """ray.train.report() with a pointer to the stored checkpoint in place of its files.

    ``stored()`` waits until the checkpoint is stored; it is called before the pointer
    is written. If storing failed, Ray Train's report fails as it does when its own
    upload fails.
    """
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
    except NotImplementedError:
        # Ray Train's local mode (num_workers=0) keeps the reported checkpoint as it is,
        # copying nothing: it gets the stored checkpoint itself.
        from validation_service.storage import ray_checkpoint

        stored()
        ray.train.report(metrics, checkpoint=ray_checkpoint(uri, reporter.settings.storage_options))
        # fit() returns as soon as the loop does, in this process: register before that.
        reporter.flush()
        return

    def write_pointer(_checkpoint, checkpoint_dir_name: str):
        # Called by Ray Train in place of copying the checkpoint's files, which ckval
        # stores: Ray Train's copy is the pointer alone.
        stored()
        path = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
        filesystem = storage.storage_filesystem
        filesystem.create_dir(path)
        with filesystem.open_output_stream(f"{path}/{POINTER_FILE}") as f:
            f.write(pointer_bytes(reporter.run, index, uri))
        return ray.train.Checkpoint(filesystem=filesystem, path=path)

    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_upload_fn=write_pointer,
        delete_local_checkpoint_after_upload=False,
    )


def resolve_checkpoint(checkpoint):
    """Follows the pointer checkpoint that report() gave Ray Train to the stored one.

    ``resolve_checkpoint(result.checkpoint)`` gives the checkpoint with the model files.
    A checkpoint that is no pointer is returned unchanged.
    """
    import json

    from validation_service.storage import ray_checkpoint

    with checkpoint.as_directory() as directory:
        pointer = os.path.join(directory, POINTER_FILE)
        if not os.path.exists(pointer):
            return checkpoint
        with open(pointer) as f:
            return ray_checkpoint(json.load(f)["uri"], resolve_settings().storage_options)


def start_run(name: str, *, start_service: bool = True) -> Client:
    """Names the run that report() outside Ray Train records into; returns its Client.

    ``start_service=False`` never connects to Ray from this process: the service, running
    elsewhere, finds the reported validations by polling the registry (within
    CKVAL_POLL_INTERVAL_S). For processes that have no Ray of their own (Dask workers).
    """
    global _current_run
    client = Client(name, start_service=start_service)
    _current_run = name
    return client


class Client:
    """Reports checkpoints of one run from any Python process (no Ray Train needed)."""

    def __init__(self, run: str, settings=None, *, start_service: bool = True):
        self.run = run
        self._reporter = _reporter(run, settings, start_service=start_service)
        self._reporter.ensure_run()

    @property
    def registry(self):
        return self._reporter.registry

    def report(
        self,
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
    ) -> int | None:
        """As trainer_integration.report(); returns the report index of the checkpoint."""
        metrics, job = _prepare(
            metrics,
            checkpoint,
            checkpoint_upload_mode,
            validate_fn,
            validate_config,
            validation_resources,
            priority,
            timeout_s,
            max_attempts,
            retry_on_timeout,
            coalesce,
        )
        if checkpoint is None:
            return None
        index, _ = self._reporter.report(metrics, checkpoint, job, checkpoint_upload_mode)
        return index

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for ASYNC uploads to be registered; raises if one failed."""
        self._reporter.flush(timeout_s)

    def wait(self, timeout_s: float = 300.0) -> None:
        """Waits for every validation of this run to finish."""
        self.flush(timeout_s)
        self._reporter.registry.wait(self.run, timeout_s=timeout_s)


def _prepare(
    metrics,
    checkpoint,
    checkpoint_upload_mode,
    validate_fn,
    validate_config,
    validation_resources,
    priority,
    timeout_s,
    max_attempts,
    retry_on_timeout,
    coalesce,
):
    """Checks every report() argument before anything is stored: (metrics, job spec)."""
    if not isinstance(metrics, dict):
        raise InvalidInput(f"metrics must be a dict, got {type(metrics).__name__}")
    if not isinstance(checkpoint_upload_mode, CheckpointUploadMode):
        raise InvalidInput(
            f"checkpoint_upload_mode must be a CheckpointUploadMode, got {checkpoint_upload_mode!r}"
        )
    if validate_fn is not None and checkpoint is None:
        raise InvalidInput("validate_fn was given without a checkpoint to validate.")
    job = None
    if validate_fn is not None:
        job = build_job_spec(
            validate_fn,
            validate_config,
            validation_resources,
            priority,
            timeout_s,
            max_attempts,
            retry_on_timeout,
            coalesce,
        )
    return plain_metrics(metrics), job


def _reporter(run: str, settings=None, *, start_service: bool = True) -> RunReporter:
    with _reporters_lock:
        reporter = _reporters.get(run)
        if reporter is None:
            reporter = _reporters[run] = RunReporter(
                run, settings or resolve_settings(), start_service=start_service
            )
        return reporter


def _set_up_rank_zero_early() -> None:
    """In rank 0 of a Ray Train run, sets its reporter up on a thread as training starts.

    The first report() then finds the registry open and the service found, instead of
    doing it while training waits (~60 ms). It writes nothing: the run is created by its
    first checkpoint. Any failure is left to the first report() to raise.
    """
    if "ray.train" not in sys.modules:  # not in a Ray Train worker: nothing to prepare
        return
    context = _ray_train_context()
    if context is None or context.get_world_rank() != 0:
        return
    run = context.get_experiment_name()
    threading.Thread(target=_set_up, args=(run,), name="ckval-set-up", daemon=True).start()


def _set_up(run: str) -> None:
    try:
        _reporter(run).prepare()
    except Exception:  # noqa: BLE001 - the first report() sets up again and raises
        logger.debug("early set-up of run %r failed", run, exc_info=True)


def _ray_train_context():
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return None


_set_up_rank_zero_early()
