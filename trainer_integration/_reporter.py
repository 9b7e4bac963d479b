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
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cloudpickle

from trainer_integration._trackers import TRACKERS_TAG, active_trackers
from validation_service.config import Settings, get_settings
from validation_service.errors import (
    CheckpointNotFound,
    CkvalError,
    InvalidInput,
    RegistryUnavailable,
    SecretsUnavailable,
)
from validation_service.jobs import ExecutorKind
from validation_service.metrics import normalize_metrics, to_plain
from validation_service.names import check_name
from validation_service.request import ValidationRequest
from validation_service.secrets import WITHHELD_VAR
from validation_service.signing import VALIDATE_CONFIG, VALIDATE_FN, PayloadTrust
from validation_service.storage import CheckpointFolder, CheckpointStorage, PersistedCheckpoint
from validation_service.validate_fn import check_module_allowed, import_validate_fn
from validation_service.validation import check_resources, check_step_and_epoch, stored_int

logger = logging.getLogger(__name__)

POINTER_FILE = "ckval_checkpoint.json"


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
    """A report whose checkpoint is being copied and registered in the background.

    Its report index is reserved in the registry on the storing thread, just before the
    copy: ``index`` and ``uri`` wait for that reservation, not for the copy.
    """

    reserved: Future  # of (report index, the URI the checkpoint is stored at)
    stored: Future  # of the PersistedCheckpoint; done once training may drop its folder
    registered: Future  # done once the checkpoint is in the registry (validation enqueued)

    @property
    def index(self) -> int:
        return self.reserved.result()[0]

    @property
    def uri(self) -> str:
        return self.reserved.result()[1]

    @classmethod
    def finished(cls, index: int, uri: str) -> StoredReport:
        """A report that was stored and registered before it was returned."""
        done: Future = Future()
        done.set_result(None)
        reserved: Future = Future()
        reserved.set_result((index, uri))
        return cls(reserved, done, done)


def _reserved_index(index: int | Future) -> int | None:
    """A report index, or None for a report whose index could not be reserved."""
    if not isinstance(index, Future):
        return index
    return None if index.exception() is not None else index.result()[0]


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
    # ValidationRequest checks priority, timeout_s, max_attempts, resources and coalesce.
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
        # A reference outside CKVAL_ALLOWED_MODULES is refused before it is imported; one
        # that does not import fails here, now.
        import_validate_fn(validate_fn, get_settings().allowed_modules)
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


def signed_request(job: ValidationRequest | None, trust: PayloadTrust) -> ValidationRequest | None:
    """The request as it is stored: its pickled validate_fn and validate_config signed
    with the reporter's key, so that the service unpickles nothing it cannot verify.

    Raises ModuleNotAllowed for a reference outside the reporter's allowed modules,
    before anything is stored. Signing a signed request changes nothing.
    """
    if job is None:
        return None
    if job.validate_fn_ref:
        check_module_allowed(job.validate_fn_ref, trust.allowed_modules)
    fn = job.validate_fn_pickle
    config = job.validate_config
    signed_fn = trust.sign(VALIDATE_FN, fn) if fn is not None else None
    signed_config = trust.sign(VALIDATE_CONFIG, config) if config is not None else None
    if signed_fn is fn and signed_config is config:
        return job
    return dataclasses.replace(job, validate_fn_pickle=signed_fn, validate_config=signed_config)


def _checked_resources(validate_fn, validation_resources: dict | None) -> dict[str, Any]:
    # Validators that launch Ray work of their own (MapBatchesValidator,
    # TorchTrainerValidator) recommend num_cpus=0 for the task that drives them.
    default = getattr(validate_fn, "recommended_resources", None) or {"num_cpus": 1}
    if validation_resources is None or (
        isinstance(validation_resources, dict) and not validation_resources
    ):
        return dict(default)
    return dict(check_resources(validation_resources))


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

        self.run = check_name("run name", run)
        self.settings = settings or resolve_settings()
        self.registry = Registry(settings=self.settings)
        self.storage = CheckpointStorage(
            self.settings.resolved_storage(), self.settings.storage_options
        )
        self._lock = threading.Lock()
        # The run is created by its first report's index reservation (or by ensure_run()):
        # setting a reporter up writes nothing. A RUNNING run (restarted workers) goes on;
        # an ended one gets a new attempt at its first report, or with CKVAL_APPEND is
        # reopened then and continued.
        self._run_id = self.registry.current_run_id(run)
        # A later attempt (its report indices start at 0 again) has its own folder in
        # storage, "<run>/attempt-N": known before the run's attempt exists.
        self.attempt = self.registry.next_attempt(run, append=self.settings.append)
        self._start_service = start_service
        self._service = None
        self._nudger: _Nudger | None = None
        self._background: ThreadPoolExecutor | None = None
        self._storing: ThreadPoolExecutor | None = None
        self._reserving: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future]] = []
        self._pending_lock = threading.Lock()
        self._trust: PayloadTrust | None = None
        # The MLflow / W&B runs the training logs to, recorded in the run's tags so that
        # the service's sinks log validated metrics there; None once recorded.
        self._trackers_to_record: dict[str, Any] | None = None
        self._trackers_seen: dict[str, Any] = {}

    @property
    def trust(self) -> PayloadTrust:
        """The key this reporter signs with and the modules its references may name."""
        if self._trust is None:
            self._trust = PayloadTrust.from_settings(self.settings)
        return self._trust

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
        following the first report; the service warms worker processes for the run's
        first validations meanwhile.
        """
        self._reserving_thread().submit(lambda: None).result()
        self._storing_thread().submit(lambda: None).result()
        self._background_threads().submit(lambda: None).result()
        if self._start_service and self._service is None:
            from validation_service.executors.ray_task import WARM_UP_MODULES
            from validation_service.service import ValidationService

            self._service = ValidationService.get(self.settings) or ValidationService.start(
                settings=self.settings
            )
            # Worker processes for the first validations, with the frameworks this
            # training uses imported: not waited for (the service keeps what it allows).
            self._service.warm_up(name for name in WARM_UP_MODULES if name in sys.modules)

    def reserve_index(self) -> int:
        """Reserves the report index of one report in the registry (creating the run).

        The registry hands each index out once, whichever process asks: any number of
        processes may report to one run, and their checkpoint folders never collide.
        One process's reports get increasing indices, in the order it reports them.
        """
        return self.registry.reserve_report_index(self.run_id)

    def scan(self, checkpoint) -> CheckpointFolder | None:
        """Lists a local checkpoint folder before its index is reserved (see
        CheckpointStorage.scan), refusing one that cannot be stored; None if remote."""
        return self.storage.scan(checkpoint.path) if _is_local(checkpoint) else None

    def adopt(self, checkpoint) -> PersistedCheckpoint:
        """Registers a checkpoint already in ckval's storage where it is (NO_UPLOAD)."""
        uri = checkpoint.path if _is_local(checkpoint) else _uri_of(checkpoint)
        return self.storage.adopt(uri)

    def persist(
        self,
        checkpoint,
        mode: CheckpointUploadMode,
        index: int,
        source: CheckpointFolder | None = None,
    ) -> PersistedCheckpoint:
        """Stores a checkpoint under its reserved index (``source``: its scan, if done)."""
        if mode is CheckpointUploadMode.NO_UPLOAD:
            return self.adopt(checkpoint)
        namespace = self.settings.namespace
        if _is_local(checkpoint):
            return self.storage.upload(
                source or checkpoint.path, namespace, self.run, index, attempt=self.attempt
            )
        with tempfile.TemporaryDirectory(prefix="ckval-upload-") as tmp:
            local = checkpoint.to_directory(tmp)
            return self.storage.upload(local, namespace, self.run, index, attempt=self.attempt)

    def register(
        self,
        index: int,
        persisted: PersistedCheckpoint,
        metrics: dict[str, Any],
        job: ValidationRequest | None,
    ):
        self._record_trackers()
        job = signed_request(job, self.trust)
        registration = self.registry.register_checkpoint(
            self.run_id,
            index,
            uri=persisted.uri,
            size_bytes=persisted.size_bytes,
            manifest_sha256=persisted.manifest_sha256,
            reported_metrics=metrics,
            step=stored_int(metrics.get("step")),
            epoch=stored_int(metrics.get("epoch")),
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
        self.note_trackers()
        job = signed_request(job, self.trust)  # refused before anything is copied
        if mode is CheckpointUploadMode.ASYNC:
            stored = self.store_and_register(metrics, checkpoint, job, delete_local=delete_local)
            return stored.index, stored.uri
        self.raise_undelivered()
        # A checkpoint that cannot be stored is refused before an index is reserved.
        if mode is CheckpointUploadMode.SYNC:
            source = self.scan(checkpoint)
            index = self.reserve_index()
            persisted = self._store(checkpoint, index, delete_local, source)
        else:
            persisted = self.adopt(checkpoint)  # stays where it is: no folder to name
            index = self.reserve_index()
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

        self.note_trackers()
        job = signed_request(job, self.trust)  # refused before anything is copied
        self.raise_undelivered()
        info = checkpoint.filesystem.get_file_info(checkpoint.path)
        if info.type != pyarrow.fs.FileType.Directory:
            raise CheckpointNotFound(checkpoint.path, "the reported checkpoint is not a folder")
        source = self.scan(checkpoint)

        def reserve() -> tuple[int, str]:
            index = self._reserve_index_patiently()
            return index, self._upload_uri(index)

        def store() -> PersistedCheckpoint:
            return self._store(checkpoint, reserved.result()[0], delete_local, source)

        # The reservation is a write to the registry: off the training thread, on a
        # thread of its own so that it never waits behind an earlier copy. Both threads
        # take reports in order, so one process's indices follow its reports.
        reserved = self._reserving_thread().submit(reserve)
        stored = self._storing_thread().submit(store)

        def register() -> None:
            persisted = stored.result()
            self._deliver(reserved.result()[0], persisted, metrics, job)

        registered = self._in_background(reserved, register)
        return StoredReport(reserved, stored, registered)

    def note_trackers(self) -> None:
        """Notes the tracker runs active in the calling thread (report()'s) for the run."""
        trackers = active_trackers()
        if trackers and trackers != self._trackers_seen:
            with self._lock:
                self._trackers_seen = trackers
                self._trackers_to_record = trackers

    def _record_trackers(self) -> None:
        trackers = self._trackers_to_record
        if trackers is not None:
            self.registry.tag_run(self.run_id, {TRACKERS_TAG: trackers})
            with self._lock:
                if self._trackers_to_record is trackers:
                    self._trackers_to_record = None

    def _reserve_index_patiently(self) -> int:
        """reserve_index(), retried with backoff while the registry is unreachable, for
        up to delivery_timeout_s (as a background registration is)."""
        deadline = time.monotonic() + self.settings.delivery_timeout_s
        delay = 0.5
        while True:
            try:
                return self.reserve_index()
            except RegistryUnavailable:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _store(
        self, checkpoint, index: int, delete_local: bool, source: CheckpointFolder | None
    ) -> PersistedCheckpoint:
        persisted = self.persist(checkpoint, CheckpointUploadMode.SYNC, index, source)
        if delete_local and _is_local(checkpoint):
            # As ray.train.report(delete_local_checkpoint_after_upload=True) does.
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        return persisted

    def _upload_uri(self, index: int) -> str:
        """Where an upload of this report goes (known before it starts)."""
        path = self.storage.checkpoint_path(
            self.settings.namespace, self.run, index, attempt=self.attempt
        )
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

    def _in_background(self, index: int | Future, fn, *args) -> Future:
        """Runs ``fn`` on a background thread, remembered for flush() under ``index``
        (the report index, or the future of its reservation)."""
        future = self._background_threads().submit(fn, *args)
        with self._pending_lock:
            self._pending.append((index, future))
        return future

    def _reserving_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._reserving is None:
                self._reserving = ThreadPoolExecutor(1, thread_name_prefix="ckval-reserve")
            return self._reserving

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
                    failed.append((_reserved_index(index), future.exception()))
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

    Ray workers inherit the variables of the process that started Ray, or get them
    through Ray's runtime_env (``ckval_env()``). Secrets are never put in runtime_env
    (Ray's state API shows it): the variables withheld there are named in CKVAL_WITHHELD,
    and a worker that lacks them in its own environment gets them, with the signing key,
    from the service actor. A process with no CKVAL_* variable at all (a remote cluster)
    gets the service's settings.
    """
    settings = get_settings()
    withheld = [
        name
        for name in os.environ.get(WITHHELD_VAR, "").split(",")
        if name and name not in os.environ
    ]
    configured = any(k.startswith("CKVAL_") and k != WITHHELD_VAR for k in os.environ)
    if configured and not withheld:
        return settings
    try:
        served = _service_settings(settings)
    except Exception as exc:  # noqa: BLE001 - no service: the defaults apply, unless withheld
        if withheld:
            raise SecretsUnavailable(withheld, f"{type(exc).__name__}: {exc}") from None
        return settings
    if not configured:
        return served
    fields = {name[len("CKVAL_") :].lower() for name in withheld}
    # The service signs with the driver's key: take it unless this process has its own.
    for field in ("secret_key", "secret_key_previous"):
        if f"CKVAL_{field.upper()}" not in os.environ:
            fields.add(field)
    return settings.model_copy(update={field: getattr(served, field) for field in fields})


def _service_settings(settings: Settings) -> Settings:
    """The running service's full settings, through an actor call (not shown by Ray)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("this process is not connected to Ray")
    actor = ray.get_actor(settings.service_name, namespace=settings.ray_namespace)
    return Settings.model_validate_json(ray.get(actor.reporter_settings_json.remote(), timeout=30))


def pointer_bytes(run: str, index: int, uri: str) -> bytes:
    """The content of the pointer checkpoint that Ray Train keeps in place of the stored one."""
    return json.dumps({"run": run, "report_index": index, "uri": uri}).encode()


def plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Reported metrics as stored; raises InvalidInput (before any copy) for a value the
    registry cannot hold, such as a "step" beyond 64 bits."""
    plain = normalize_metrics({k: to_plain(v) for k, v in metrics.items()}, what="metrics")
    check_step_and_epoch(plain)
    return plain


def _is_local(checkpoint) -> bool:
    import pyarrow.fs

    return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)


def _uri_of(checkpoint) -> str:
    type_name = checkpoint.filesystem.type_name
    return f"{type_name}://{checkpoint.path}"
