"""The reporting side of ckval: persist, register + enqueue, report to Ray, nudge."""

from __future__ import annotations

import atexit
import dataclasses
import enum
import json
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cloudpickle

from validation_service.config import Settings, get_settings
from validation_service.errors import (
    CheckpointNotFound,
    CkvalError,
    InvalidInput,
    RegistryUnavailable,
)
from validation_service.jobs import ExecutorKind
from validation_service.metrics import normalize_metrics, to_plain
from validation_service.request import ValidationRequest
from validation_service.storage import CheckpointStorage, PersistedCheckpoint
from validation_service.validate_fn import import_validate_fn

logger = logging.getLogger(__name__)

POINTER_FILE = "ckval_checkpoint.json"
_RESOURCE_KEYS = {"num_cpus", "num_gpus", "memory", "resources", "accelerator_type"}


class ReportNotDelivered(CkvalError):
    """Reports that report() acknowledged but that were never stored or registered."""

    def __init__(self, run: str, failures: list[tuple[int, BaseException]]):
        self.run = run
        self.report_indices = [index for index, _ in failures]
        last = failures[-1][1]
        super().__init__(
            f"{len(failures)} report(s) of run {run!r} (report indices "
            f"{self.report_indices}) were not delivered: {type(last).__name__}: {last}. "
            "If the registry was unreachable, their checkpoints are in storage: check "
            "CKVAL_DATABASE_URL and report them again. If storing failed, check the "
            "checkpoint folder and CKVAL_STORAGE."
        )


@dataclasses.dataclass(frozen=True)
class StoredReport:
    """A report whose checkpoint is being copied and registered in the background."""

    index: int
    uri: str
    stored: Future  # of the PersistedCheckpoint; done once training may drop its folder
    registered: Future  # done once the checkpoint is in the registry (validation enqueued)

    @classmethod
    def finished(cls, index: int, uri: str) -> StoredReport:
        """A report that was stored and registered before it was returned."""
        done: Future = Future()
        done.set_result(None)
        return cls(index, uri, done, done)


class CheckpointUploadMode(enum.Enum):
    """How report() persists the checkpoint, as in ray.train.CheckpointUploadMode.

    SYNC: upload before report() returns. ASYNC: upload in the background; the
    validation is enqueued once the upload is complete. NO_UPLOAD: the checkpoint is
    already in ckval's storage (e.g. distributed checkpoint shards); register it there.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"


def pool_for(resources: dict[str, Any]) -> str:
    """The concurrency pool a job counts against: its accelerator type, GPU, or CPU."""
    if resources.get("accelerator_type"):
        return str(resources["accelerator_type"])
    return "GPU" if resources.get("num_gpus") else "CPU"


def validation_request(
    validate_fn: Callable[..., dict] | str,
    validate_config: dict | None,
    validation_resources: dict | None,
    priority: int,
    timeout_s: float | None,
    max_attempts: int,
    retry_on_timeout: bool = False,
    coalesce: str | None = None,
) -> ValidationRequest:
    """The ValidationRequest that a report() asks for, every argument checked up front.

    Raises InvalidInput naming the bad argument, before anything is stored.
    """
    fn_ref, fn_pickle, fn_name = _validate_fn_payload(validate_fn)
    config_bytes = _config_payload(validate_config)
    resources = _checked_resources(validate_fn, validation_resources)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidInput(f"priority must be an int, got {priority!r}")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise InvalidInput(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise InvalidInput(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    if coalesce not in (None, "latest"):
        raise InvalidInput(f"coalesce must be None or 'latest', got {coalesce!r}")
    return ValidationRequest(
        executor_kind=ExecutorKind.RAY_TASK.value,
        pool=pool_for(resources),
        validate_fn_name=fn_name,
        validate_fn_ref=fn_ref,
        validate_fn_pickle=fn_pickle,
        validate_config=config_bytes,
        resources=resources,
        priority=priority,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
        retry_on_timeout=bool(retry_on_timeout),
        coalesce=coalesce,
    )


def _validate_fn_payload(validate_fn) -> tuple[str | None, bytes | None, str]:
    """(import reference, pickled callable, name) of a validate_fn; one of the first two."""
    if isinstance(validate_fn, str):
        import_validate_fn(validate_fn)  # a reference that does not import fails here, now
        return validate_fn, None, validate_fn
    if not callable(validate_fn):
        raise InvalidInput(
            f"validate_fn must be a callable (checkpoint, config) -> dict or a "
            f"'package.module:function' string, got {type(validate_fn).__name__}."
        )
    try:
        pickled = _pickled(validate_fn)
    except Exception as exc:  # noqa: BLE001 - any pickling error is the user's to fix
        raise InvalidInput(
            f"validate_fn {validate_fn!r} cannot be pickled ({exc}). Define it at module "
            "level or pass its reference as 'package.module:function'."
        ) from None
    return None, pickled, getattr(validate_fn, "__qualname__", type(validate_fn).__name__)


def _config_payload(validate_config: dict | None) -> bytes:
    if validate_config is not None and not isinstance(validate_config, dict):
        raise InvalidInput(f"validate_config must be a dict, got {type(validate_config).__name__}.")
    try:
        return cloudpickle.dumps(validate_config or {})
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise InvalidInput(
            f"validate_config cannot be pickled ({exc}); it is stored until the validation "
            "runs. Pass plain values, paths or URIs instead of open handles or locks."
        ) from None


def _checked_resources(validate_fn, validation_resources: dict | None) -> dict[str, Any]:
    # Validators that launch Ray work of their own (MapBatchesValidator,
    # TorchTrainerValidator) recommend num_cpus=0 for the task that drives them.
    default = getattr(validate_fn, "recommended_resources", None) or {"num_cpus": 1}
    resources = dict(validation_resources or default)
    unknown = set(resources) - _RESOURCE_KEYS
    if unknown:
        raise InvalidInput(
            f"validation_resources has unknown keys {sorted(unknown)}; "
            f"use {sorted(_RESOURCE_KEYS)}."
        )
    for key in ("num_cpus", "num_gpus", "memory"):
        value = resources.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise InvalidInput(
                f"validation_resources[{key!r}] must be a number >= 0, got {value!r}"
            )
    return resources


# Each validate_fn is pickled once per process, as Ray pickles ValidationConfig(fn) once
# per trainer; what changes from report to report belongs in validate_config.
_PICKLED_MAX = 32
_pickled_fns: dict[int, tuple[Callable[..., Any], bytes]] = {}
_pickled_lock = threading.Lock()


def _pickled(fn: Callable[..., Any]) -> bytes:
    with _pickled_lock:
        cached = _pickled_fns.get(id(fn))
        if cached is not None and cached[0] is fn:
            return cached[1]
    data = cloudpickle.dumps(fn)
    with _pickled_lock:
        if len(_pickled_fns) >= _PICKLED_MAX:
            _pickled_fns.pop(next(iter(_pickled_fns)))
        _pickled_fns[id(fn)] = (fn, data)  # holds fn: its id is not reused meanwhile
    return data


class RunReporter:
    """Reports checkpoints of one run from one process; thread-safe."""

    def __init__(self, run: str, settings: Settings | None = None, *, start_service: bool = True):
        from validation_service.registry.registry import Registry

        self.run = run
        self.settings = settings or resolve_settings()
        self.registry = Registry(settings=self.settings)
        self.storage = CheckpointStorage(
            self.settings.resolved_storage(), self.settings.storage_options
        )
        self._lock = threading.Lock()
        # The run is created by its first registered checkpoint (or by ensure_run()):
        # setting a reporter up writes nothing.
        # A RUNNING run (restarted workers) goes on; an ended one gets a new attempt at
        # its first report, or with CKVAL_APPEND is reopened then and continued.
        self._run_id = self.registry.current_run_id(run)
        continued = (
            self.registry.current_run_id(run, append=True) if self.settings.append else self._run_id
        )
        # The run's folder in storage: its name, with "attempt-N" below it for a later
        # attempt (whose report indices start at 0 again). Known before the run exists:
        # the run is created by its first registered checkpoint.
        attempt = self.registry.next_attempt(run, append=self.settings.append)
        self.storage_run = run if attempt == 1 else f"{run}/attempt-{attempt}"
        self._next_index = 0 if continued is None else self.registry.next_report_index(continued)
        self._start_service = start_service
        self._service = None
        self._nudger: _Nudger | None = None
        self._background: ThreadPoolExecutor | None = None
        self._storing: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future]] = []
        self._pending_lock = threading.Lock()

    @property
    def run_id(self) -> int:
        return self.ensure_run()

    def ensure_run(self) -> int:
        """The run's id, creating the run in the registry if it is not there yet."""
        if self._run_id is None:
            with self._lock:
                if self._run_id is None:
                    self._run_id = self.registry.ensure_run(
                        self.run, storage_root=self.storage.root_uri, append=self.settings.append
                    )
        return self._run_id

    def prepare(self) -> None:
        """Gets ready for a first report while training starts; writes nothing.

        Starts the background threads and finds the service, starting it if none runs
        (the embedded default), so that its cold start overlaps training instead of
        following the first report.
        """
        self._storing_thread().submit(lambda: None).result()
        self._background_threads().submit(lambda: None).result()
        if self._start_service and self._service is None:
            from validation_service.service import ValidationService

            self._service = ValidationService.get(self.settings) or ValidationService.start(
                settings=self.settings
            )

    def reserve_index(self) -> int:
        with self._lock:
            index = self._next_index
            self._next_index += 1
            return index

    def persist(self, checkpoint, mode: CheckpointUploadMode, index: int) -> PersistedCheckpoint:
        if mode is CheckpointUploadMode.NO_UPLOAD:
            uri = checkpoint.path if _is_local(checkpoint) else _uri_of(checkpoint)
            return self.storage.adopt(uri)
        run = self.storage_run
        if _is_local(checkpoint):
            return self.storage.upload(checkpoint.path, self.settings.namespace, run, index)
        with tempfile.TemporaryDirectory(prefix="ckval-upload-") as tmp:
            local = checkpoint.to_directory(tmp)
            return self.storage.upload(local, self.settings.namespace, run, index)

    def register(
        self,
        index: int,
        persisted: PersistedCheckpoint,
        metrics: dict[str, Any],
        job: ValidationRequest | None,
    ):
        registration = self.registry.register_checkpoint(
            self.run_id,
            index,
            uri=persisted.uri,
            size_bytes=persisted.size_bytes,
            manifest_sha256=persisted.manifest_sha256,
            reported_metrics=metrics,
            step=_int_or_none(metrics.get("step")),
            epoch=_int_or_none(metrics.get("epoch")),
            job=job,
        )
        if job is not None:
            self.nudge()
        return registration

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint,
        job: ValidationRequest | None,
        mode: CheckpointUploadMode,
        *,
        delete_local: bool = False,
    ) -> tuple[int, str]:
        """Persists and registers one checkpoint; returns its report index and URI.

        SYNC and NO_UPLOAD return once it is registered (or, with the registry
        unreachable, once stored: the registration is retried in the background).
        ASYNC returns at once: store_and_register(). Raises ReportNotDelivered first if
        an earlier report could not be delivered.
        """
        if mode is CheckpointUploadMode.ASYNC:
            stored = self.store_and_register(metrics, checkpoint, job, delete_local=delete_local)
            return stored.index, stored.uri
        self.raise_undelivered()
        index = self.reserve_index()
        if mode is CheckpointUploadMode.SYNC:
            persisted = self._store(checkpoint, index, delete_local)
        else:
            persisted = self.persist(checkpoint, mode, index)
        self._register_or_deliver(index, persisted, metrics, job)
        return index, persisted.uri

    def store_and_register(
        self,
        metrics: dict[str, Any],
        checkpoint,
        job: ValidationRequest | None,
        *,
        delete_local: bool = False,
    ) -> StoredReport:
        """Copies a checkpoint into storage and registers it, both in the background.

        The copy starts at once on its own thread, reading the checkpoint's folder; the
        folder is deleted once copied when ``delete_local``. The registration (and the
        validation's enqueueing) follows as soon as the copy is done, retried while the
        registry is unreachable. A checkpoint that is not a folder is refused here,
        before anything starts. Raises ReportNotDelivered first if an earlier report
        could not be delivered.
        """
        import pyarrow.fs

        self.raise_undelivered()
        info = checkpoint.filesystem.get_file_info(checkpoint.path)
        if info.type != pyarrow.fs.FileType.Directory:
            raise CheckpointNotFound(checkpoint.path, "the reported checkpoint is not a folder")
        index = self.reserve_index()
        stored = self._storing_thread().submit(self._store, checkpoint, index, delete_local)

        def register() -> None:
            self._deliver(index, stored.result(), metrics, job)

        registered = self._in_background(index, register)
        return StoredReport(index, self._upload_uri(index), stored, registered)

    def _store(self, checkpoint, index: int, delete_local: bool) -> PersistedCheckpoint:
        persisted = self.persist(checkpoint, CheckpointUploadMode.SYNC, index)
        if delete_local and _is_local(checkpoint):
            # As ray.train.report(delete_local_checkpoint_after_upload=True) does.
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        return persisted

    def _upload_uri(self, index: int) -> str:
        """Where an upload of this report goes (known before it starts)."""
        path = self.storage.checkpoint_path(self.settings.namespace, self.storage_run, index)
        return self.storage.uri_for(path)

    def _register_or_deliver(
        self, index: int, persisted: PersistedCheckpoint, metrics, job
    ) -> None:
        try:
            self.register(index, persisted, metrics, job)
        except RegistryUnavailable as exc:
            # The checkpoint is stored; the registry is unreachable for the moment.
            logger.warning(
                "registry unreachable (%s); report %d of run %r is delivered in the background",
                type(exc.orig).__name__ if exc.orig is not None else "unknown",
                index,
                self.run,
            )
            self._in_background(index, self._deliver, index, persisted, metrics, job)

    def _in_background(self, index: int, fn, *args) -> Future:
        future = self._background_threads().submit(fn, *args)
        with self._pending_lock:
            self._pending.append((index, future))
        return future

    def _storing_thread(self) -> ThreadPoolExecutor:
        # Its own thread: deliveries retrying in the background never queue a copy.
        with self._lock:
            if self._storing is None:
                self._storing = ThreadPoolExecutor(1, thread_name_prefix="ckval-store")
            return self._storing

    def _background_threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(2, thread_name_prefix="ckval-report")
                atexit.register(self._flush_at_exit)
            return self._background

    def _deliver(self, index: int, persisted: PersistedCheckpoint, metrics, job) -> None:
        """Registers with backoff until delivery_timeout_s; the registration is idempotent."""
        deadline = time.monotonic() + self.settings.delivery_timeout_s
        delay = 0.5
        while True:
            try:
                self.register(index, persisted, metrics, job)
                return
            except RegistryUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                if delay == 0.5:
                    logger.warning(
                        "registry unreachable (%s); report %d of run %r is retried in the "
                        "background",
                        type(exc.orig).__name__ if exc.orig is not None else "unknown",
                        index,
                        self.run,
                    )
                time.sleep(delay)
                delay = min(delay * 2, 15.0)

    def raise_undelivered(self) -> None:
        """Raises ReportNotDelivered for background reports that failed for good."""
        failed = []
        with self._pending_lock:
            still_pending = []
            for index, future in self._pending:
                if not future.done():
                    still_pending.append((index, future))
                elif future.exception() is not None:
                    failed.append((index, future.exception()))
            self._pending = still_pending
        if failed:
            raise ReportNotDelivered(self.run, failed)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for background uploads and deliveries; raises if one failed."""
        with self._pending_lock:
            pending = list(self._pending)
        for _, future in pending:
            try:
                future.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - collected and raised below
                pass
        self.raise_undelivered()

    def _flush_at_exit(self) -> None:
        try:
            self.flush(self.settings.delivery_timeout_s)
        except ReportNotDelivered as exc:
            logger.error("%s", exc)

    def nudge(self) -> None:
        """Tells the service there is new work (best effort: it also polls).

        Nudges go out from a background thread, which finds (or starts) the service
        first; reports that arrive faster than one per NUDGE_GAP_S share a nudge, and
        report() never waits for the call. A pending nudge is sent before the process
        exits, so that a script's last reports are not left waiting for a poll.
        """
        if not self._start_service:
            return
        with self._lock:
            if self._nudger is None:
                self._nudger = _Nudger(self._send_nudge)
                atexit.register(self._nudger.flush, self.settings.delivery_timeout_s)
        self._nudger.request()

    def _send_nudge(self) -> bool:
        try:
            if self._service is None:
                from validation_service.service import ValidationService

                self._service = ValidationService.get(self.settings) or ValidationService.start(
                    settings=self.settings
                )
            self._service.nudge()
            return True
        except Exception:  # noqa: BLE001 - the job is durable; the service will poll it
            # Handled: the service polls the registry too. The traceback is for debugging.
            logger.warning("could not reach the ckval service to nudge it; it will poll")
            logger.debug("nudge failed", exc_info=True)
            self._service = None
            return False


# Reports closer together than this share one nudge (adds at most this to dispatch).
NUDGE_GAP_S = 0.02


class _Nudger:
    """Sends the nudges of one reporter from a daemon thread, coalescing bursts."""

    def __init__(self, send: Callable[[], bool]):
        self._send = send
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="ckval-nudge", daemon=True).start()

    def request(self) -> None:
        with self._lock:
            self._idle.clear()
            self._wanted.set()

    def flush(self, timeout_s: float) -> None:
        """Waits until no nudge is pending (at exit: the service may still be starting)."""
        self._idle.wait(timeout_s)

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            self._send()
            time.sleep(NUDGE_GAP_S)
            with self._lock:
                if not self._wanted.is_set():
                    self._idle.set()


def resolve_settings() -> Settings:
    """This process's settings: CKVAL_* variables, else those of the running service.

    Ray workers inherit the variables of the process that started Ray; on a remote
    cluster they get the deployed service's settings instead.
    """
    settings = get_settings()
    if any(k.startswith("CKVAL_") for k in os.environ):
        return settings
    try:
        import ray

        if ray.is_initialized():
            actor = ray.get_actor(settings.service_name, namespace=settings.ray_namespace)
            return Settings.model_validate_json(ray.get(actor.settings_json.remote(), timeout=30))
    except Exception:  # noqa: BLE001 - no service yet: the defaults apply
        pass
    return settings


def pointer_bytes(run: str, index: int, uri: str) -> bytes:
    """The content of the pointer checkpoint that Ray Train keeps in place of the stored one."""
    return json.dumps({"run": run, "report_index": index, "uri": uri}).encode()


def plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return normalize_metrics({k: to_plain(v) for k, v in metrics.items()}, what="metrics")


def _is_local(checkpoint) -> bool:
    import pyarrow.fs

    return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)


def _uri_of(checkpoint) -> str:
    type_name = checkpoint.filesystem.type_name
    return f"{type_name}://{checkpoint.path}"


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None
