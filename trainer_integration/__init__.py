"""What training code imports: report() with a validate_fn, runs outside Ray Train, clients."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from trainer_integration._delivery import ReportNotDelivered, StoredReport
from trainer_integration._parts import ReportKey, ShardReporter, next_report_key
from trainer_integration._ray_reports import RayReportLine, report_line
from trainer_integration._reporter import POINTER_FILE, RunReporter, pointer_bytes
from trainer_integration._request import (
    CheckpointUploadMode,
    PreparedReport,
    ReportOptions,
    prepare_report,
    upload_mode,  # noqa: F401 - the front-door callbacks take Ray Train's mode too
)
from trainer_integration._service_link import resolve_settings
from trainer_integration._stopping import attach, forget, should_stop
from validation_service.errors import InvalidInput
from validation_service.names import RULE as NAME_RULE
from validation_service.names import check_name, is_safe_name, suggested_name

__all__ = [
    "CheckpointUploadMode",
    "Client",
    "ReportNotDelivered",
    "RunStatusCallback",
    "TensorflowTrainer",
    "TorchTrainer",
    "ray_results_path",
    "report",
    "resolve_checkpoint",
    "should_stop",
    "start_run",
]

logger = logging.getLogger(__name__)


def __getattr__(name: str):
    # RunStatusCallback subclasses a Ray Train class: importing it imports Ray Train,
    # which training code that only reports need not pay for.
    if name == "RunStatusCallback":
        from trainer_integration.run_status import RunStatusCallback

        return RunStatusCallback
    if name in ("TorchTrainer", "TensorflowTrainer"):  # Ray's trainers, the drop-in form
        from trainer_integration import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    delete_local_checkpoint_after_upload: bool | None = None,
    validation: bool | Any = False,
) -> None:
    """Reports metrics and a checkpoint; its validation runs later, elsewhere.

    Inside a Ray Train worker call it on every rank, as ``ray.train.report``: rank 0
    passes the checkpoint and the others ``report({}, None)``, or every rank passes its
    own folder (a sharded save: FSDP, DeepSpeed, torch.distributed.checkpoint), and the
    union of the ranks' files is one checkpoint, registered once every rank's part is
    stored (see docs/sharded-checkpoints.md). The checkpoint is copied
    into ckval's storage, and registered with its validation enqueued as soon as the
    copy is done; Ray Train gets a pointer checkpoint so ``Result.checkpoints`` still
    lists it. Training never waits for Ray Train's result queue: SYNC returns once
    ckval's copy is stored (the folder may then be deleted), ASYNC returns at once and
    copies in the background (keep the folder: it is deleted once copied, as Ray Train
    does, unless ``delete_local_checkpoint_after_upload=False``). A checkpoint that
    cannot be stored fails the run, as Ray Train's failed upload does; every
    registration is done before the worker exits. Outside Ray Train, call
    ``start_run(name)`` first; there SYNC returns once the checkpoint is registered.
    Returns without waiting for validation.

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
    train_context = _ray_train_context()
    if train_context is not None and checkpoint is None:
        # A rank that reports no checkpoint validates nothing: every rank may pass the
        # same validation arguments, whichever rank passes the checkpoint.
        options = options.without_validation()
    prepared = prepare_report(metrics, checkpoint, options)
    if train_context is None:
        _report_outside_ray_train(prepared, checkpoint)
    else:
        _report_in_ray_train(train_context, prepared, checkpoint)


def _report_outside_ray_train(prepared: PreparedReport, checkpoint) -> None:
    if _current_run is None:
        raise InvalidInput(
            "report() outside a Ray Train worker needs a run: call "
            "trainer_integration.start_run('my-run') first, or use Client('my-run')."
        )
    if checkpoint is None:
        return
    reporter = _reporter(_current_run)
    attach(_current_run, reporter)  # wakes should_stop()'s watcher after registrations
    if prepared.mode is CheckpointUploadMode.ASYNC:
        # Returns at once: the index is reserved in the background (Client.report waits
        # for it, to return it).
        reporter.store_and_register(
            prepared.metrics, checkpoint, prepared.job, delete_local=prepared.delete_local
        )
        return
    _report_and_register(reporter, prepared, checkpoint)


def _report_and_register(
    reporter: RunReporter, prepared: PreparedReport, checkpoint
) -> tuple[int, str]:
    """A report outside Ray Train: the checkpoint's report index and URI, once registered
    (ASYNC: once its index is reserved)."""
    return reporter.report(prepared, checkpoint)


def _report_options(options: dict[str, Any]) -> ReportOptions:
    """Client.report()'s keyword options, which are report()'s (written once, there)."""
    unknown = sorted(set(options) - {field.name for field in dataclasses.fields(ReportOptions)})
    if unknown:
        raise TypeError(f"Client.report() got an unexpected keyword argument {unknown[0]!r}")
    return ReportOptions(**options)


def _report_in_ray_train(context, prepared: PreparedReport, checkpoint) -> None:
    line = report_line()
    metrics, mode = prepared.metrics, prepared.mode
    # With several ranks every report() call has a key, the same on each rank: a rank's
    # checkpoint is its part of that report's checkpoint (sharded saves write one each).
    key = next_report_key(context, line) if context.get_world_size() > 1 else None
    if checkpoint is None:
        _to_ray_train(line, metrics)
        return
    reporter = _reporter(ray_train_run_name(context))
    attach(reporter.run, reporter)  # wakes should_stop()'s watcher after registrations
    if key is not None:
        _report_shard(line, context.get_world_rank(), reporter, prepared, checkpoint, key)
        return
    try:
        if mode is CheckpointUploadMode.NO_UPLOAD:
            stored = StoredReport.finished(*reporter.report(prepared, checkpoint))
        else:
            # SYNC returns once ckval's own copy is stored (training may delete its folder);
            # ASYNC at once. Neither waits for the registry or the service.
            stored = reporter.store_and_register(
                metrics,
                checkpoint,
                prepared.job,
                delete_local=prepared.delete_local,
                copy_now=mode is CheckpointUploadMode.SYNC,
            )
    except Exception:
        # The other ranks are in this report too: keep in step.
        _to_ray_train(line, metrics)
        raise
    _report_pointer(line, reporter, metrics, checkpoint, stored)


def _report_shard(
    line: RayReportLine | None,
    rank: int,
    reporter: RunReporter,
    prepared: PreparedReport,
    checkpoint,
    key: ReportKey,
) -> None:
    """One rank's folder as its part of the report's checkpoint (see _parts.py).

    This rank stores its part; then, on Ray Train's upload thread, enters Ray Train's
    report of this step, whose rank sync every rank passes only after storing its own
    part: the lowest rank that stored one seals the checkpoint there (registering it
    with its validation), and each gives Ray Train the pointer.
    """
    import ray.train

    shards = ShardReporter(reporter, rank)
    metrics = prepared.metrics
    try:
        shard = shards.report(prepared, checkpoint, key)
    except Exception:
        _to_ray_train(line, metrics)  # the other ranks are in this report too
        raise

    def seal_and_point(_checkpoint, checkpoint_dir_name: str):
        shards.seal(shard)
        index = shard.registered.result().report_index
        return _write_pointer(reporter, checkpoint_dir_name, index, shard.uri)

    def report_to_ray_train(**mode) -> None:
        shard.registered.result()  # stored before the ranks sync, so the sealer finds it
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_upload_fn=seal_and_point,
            delete_local_checkpoint_after_upload=False,
            **mode,
        )

    if line is None:
        report_to_ray_train(checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
    else:
        line.submit(report_to_ray_train)


def _to_ray_train(line: RayReportLine | None, metrics: dict) -> None:
    """A report without a checkpoint, to keep this rank in step with the others."""
    import ray.train

    if line is None:
        ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
    else:
        line.submit(lambda: ray.train.report(metrics))


def _report_pointer(
    line: RayReportLine | None,
    reporter: RunReporter,
    metrics: dict,
    checkpoint,
    stored: StoredReport,
) -> None:
    """Hands Ray Train a pointer to the stored checkpoint, off the training thread.

    The pointer is written once ckval's copy is registered, on Ray Train's upload
    thread, which Ray Train waits for before the worker finishes: no acknowledged report
    is lost when the train function returns. A copy or registration that failed fails
    the run, as Ray Train's own failed upload does. Without the line (another Ray
    version) the same happens through ``ray.train.report`` in ASYNC mode.
    """
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
    except NotImplementedError:
        # Ray Train's local mode (num_workers=0) keeps the reported checkpoint as it is,
        # copying nothing: it gets the stored checkpoint itself.
        from validation_service.storage import ray_checkpoint

        stored.stored.result()
        stored_checkpoint = ray_checkpoint(stored.uri, reporter.settings.storage_options)
        ray.train.report(metrics, checkpoint=stored_checkpoint)
        # fit() returns as soon as the loop does, in this process: register before that.
        stored.registered.result()
        return

    def write_pointer(_checkpoint, checkpoint_dir_name: str):
        stored.stored.result()
        pointer = _write_pointer(reporter, checkpoint_dir_name, stored.index, stored.uri, storage)
        stored.registered.result()
        return pointer

    if line is None:
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=write_pointer,
            delete_local_checkpoint_after_upload=False,
        )
        return
    # On the upload thread Ray Train's SYNC mode is the whole report: the rank sync, the
    # pointer, the result queue; the training thread waits for none of them.
    line.submit(
        lambda: ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_upload_fn=write_pointer,
            delete_local_checkpoint_after_upload=False,
        )
    )


def _write_pointer(
    reporter: RunReporter, checkpoint_dir_name: str, index: int, uri: str, storage=None
):
    """Writes the pointer to a stored checkpoint into Ray Train's checkpoint folder
    ``checkpoint_dir_name``; returns it as the checkpoint Ray Train keeps."""
    import ray.train

    storage = storage or ray.train.get_context().get_storage()
    path = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
    filesystem = storage.storage_filesystem
    filesystem.create_dir(path)
    with filesystem.open_output_stream(f"{path}/{POINTER_FILE}") as f:
        f.write(pointer_bytes(reporter.run, index, uri))
    return ray.train.Checkpoint(filesystem=filesystem, path=path)


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


def ray_results_path() -> str:
    """Where Ray Train keeps its results next to ckval's: ``CKVAL_HOME/ray_results``.

    For ``RunConfig(storage_path=ray_results_path())``, so that every folder a program
    using ckval writes is under one home (Ray's own default is ``~/ray_results``).
    """
    return str(resolve_settings().resolved_home() / "ray_results")


def start_run(name: str, *, start_service: bool = True, append: bool = False) -> Client:
    """Names the run that report() outside Ray Train records into; returns its Client.

    ``start_service=False`` never connects to Ray from this process: the service, running
    elsewhere, finds the reported validations by polling the registry (within
    CKVAL_POLL_INTERVAL_S). For processes that have no Ray of their own (Dask workers).
    A name whose run ended starts a new attempt, unless ``append`` (see Client). Use the
    Client as a context manager, or close() it, to mark the run FINISHED (FAILED on an
    exception).
    """
    global _current_run
    client = Client(name, start_service=start_service, append=append)
    _current_run = name
    return client


class Client:
    """Reports checkpoints of one run from any Python process (no Ray Train needed).

    The run is RUNNING until close() (or the end of a ``with Client(...)`` block) marks it
    FINISHED, or FAILED when the block raised. A run name used again after its run ended
    starts a new attempt (report indices from 0; best_checkpoints and latest_checkpoint
    read the latest attempt); ``append=True`` keeps adding to the last attempt instead.
    """

    def __init__(
        self, run: str, settings=None, *, start_service: bool = True, append: bool = False
    ):
        self.run = run
        settings = settings or resolve_settings()
        if append and not settings.append:
            settings = settings.model_copy(update={"append": True})
        self._reporter = _reporter(run, settings, start_service=start_service)
        self._reporter.ensure_run()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def close(self, *, failed: bool = False) -> None:
        """Delivers what is pending and ends the run: FINISHED, or FAILED when ``failed``
        or when a report could not be delivered (which is raised)."""
        global _current_run
        from validation_service.jobs import RunStatus

        try:
            self.flush()
        except Exception:
            failed = True
            raise
        finally:
            status = RunStatus.FAILED if failed else RunStatus.FINISHED
            self._reporter.writer.ledger.finish_run(self.run, status)
            with _reporters_lock:
                if _reporters.get(self.run) is self._reporter:
                    del _reporters[self.run]  # the next Client of this name starts afresh
            forget(self.run)  # its stop watcher too
            if _current_run == self.run:
                _current_run = None

    @property
    def registry(self):
        return self._reporter.registry

    def report(self, metrics: dict, checkpoint=None, **options: Any) -> int | None:
        """As trainer_integration.report(), with its keyword options; returns the report
        index of the checkpoint (in ASYNC mode once it is reserved)."""
        prepared = prepare_report(metrics, checkpoint, _report_options(options))
        if checkpoint is None:
            return None
        attach(self.run, self._reporter)
        index, _ = _report_and_register(self._reporter, prepared, checkpoint)
        return index

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for ASYNC uploads to be registered; raises if one failed."""
        self._reporter.flush(timeout_s)

    def wait(
        self, timeout_s: float = 300.0, *, progress: bool = False, raise_on_failure: bool = False
    ) -> None:
        """Waits for every validation of this run to finish (see Registry.wait)."""
        self.flush(timeout_s)
        self._reporter.registry.wait(
            self.run, timeout_s=timeout_s, progress=progress, raise_on_failure=raise_on_failure
        )


def _client_report_signature() -> inspect.Signature:
    """report()'s signature with ``self``, returning the report index: what
    help(Client.report) shows."""
    front = inspect.signature(report)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return front.replace(
        parameters=[this, *front.parameters.values()], return_annotation="int | None"
    )


Client.report.__signature__ = _client_report_signature()


def ray_train_run_name(context) -> str:
    """The ckval run of a Ray Train run: its RunConfig name, which must be a safe name.

    Ray Train takes any string as ``RunConfig(name=...)`` and makes it a folder of its
    own storage; ckval refuses rather than maps the names it cannot store as one folder
    (with '/', spaces, a leading '.'): the run name is what users query by
    (``registry.checkpoints(name)``, ``ckval runs``, ``/runs/{name}``), and a mapped
    name would not find their run. Ray's default name, ``ray_train_run-<date>_<time>``,
    is valid.
    """
    name = context.get_experiment_name()
    if not is_safe_name(name):
        raise InvalidInput(
            f"Ray Train run name {name!r} (RunConfig(name=...)) cannot name a ckval run: "
            f"use {NAME_RULE}. Rename the run, for example "
            f"RunConfig(name={suggested_name(name)!r}); nothing was stored."
        )
    return name


def _reporter(run: str, settings=None, *, start_service: bool = True) -> RunReporter:
    check_name("run name", run)
    with _reporters_lock:
        reporter = _reporters.get(run)
        if reporter is None:
            reporter = _reporters[run] = RunReporter(
                run, settings or resolve_settings(), start_service=start_service
            )
        return reporter


def _set_up_rank_zero_early() -> None:
    """In rank 0 of a Ray Train run, sets its reporter up on a thread as training starts.

    The first report() then finds the registry open and the service running (started
    now if none runs, so that its cold start overlaps training), instead of doing it
    while training waits. It writes nothing to the registry: the run is created by its
    first checkpoint. Any failure is left to the first report() to raise.
    """
    if "ray.train" not in sys.modules:  # not in a Ray Train worker: nothing to prepare
        return
    from validation_service._ray_compat import worker_train_context

    context = worker_train_context()  # without importing Ray Tune, as ray.train.get_context
    if context is None or context.get_world_rank() != 0:
        return
    run = context.get_experiment_name()
    if not is_safe_name(run):  # the first report() raises, saying how to rename it
        return
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
