"""One run's reporter in one process: stores checkpoints and registers them with their
validation, in report order, without making training wait for the registry.

Making a reporter costs nothing: its settings, registry writer and threads are made on
first use, the writer on a thread of its own (``prepare()`` starts it while training
starts). The writer (composition.ReportWriter: the Ledger and the Assemblies) is all the
reporting path opens; the users' Registry of ``registry`` shares its connections and is
made only when asked for (Client.registry, should_stop's watcher, the callbacks).

An ASYNC report returns after listing the checkpoint folder; a SYNC report in Ray Train
once its own copy is stored: into the run's folder under a staging name when the
storage is local, renamed to its report index once the index is reserved.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from trainer_integration._delivery import (
    PendingReports,
    StoredReport,
    unavailable_reason,
    with_backoff,
)
from trainer_integration._imports import import_once
from trainer_integration._journal import Record, ReportJournal
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from trainer_integration._service_link import ServiceLink, resolve_settings
from trainer_integration._trackers import TRACKERS_TAG, active_trackers
from validation_service.errors import CheckpointNotFound
from validation_service.names import check_name
from validation_service.payloads import signed_request
from validation_service.request import ValidationRequest
from validation_service.signing import PayloadTrust, job_binding
from validation_service.storage import (
    CheckpointFolder,
    CheckpointStorage,
    PersistedCheckpoint,
    StagedCheckpoint,
    scan_folder,
)
from validation_service.validation import stored_int

if TYPE_CHECKING:
    from validation_service.config import Settings
    from validation_service.errors import RegistryUnavailable

logger = logging.getLogger(__name__)

# The reporter's threads: the registry side opened once; reservations and copies each in
# report order (a copy never waits behind a retried delivery); registrations.
_THREADS = {"set-up": 1, "reserve": 1, "store": 1, "seal": 1, "report": 2}


@dataclasses.dataclass(frozen=True)
class _Opened:
    """The registry side of a reporter, opened off the training thread."""

    writer: Any  # composition.ReportWriter
    attempt: int  # the run attempt this process reports into (its own storage folder)


class RunReporter:
    """Reports checkpoints of one run from one process; thread-safe."""

    def __init__(self, run: str, settings: Settings | None = None, *, start_service: bool = True):
        self.run = check_name("run name", run)
        self._settings = settings
        self._storage: CheckpointStorage | None = None
        self._opened: Future | None = None
        self._registry = None  # the users' Registry on the writer's database, when asked
        self._run_id: int | None = None
        self._lock = threading.Lock()
        self._settings_lock = threading.Lock()
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._threads_lock = threading.Lock()
        self._pending = PendingReports(self.run)
        self._trust: PayloadTrust | None = None
        self._link = ServiceLink(lambda: self.settings) if start_service else None
        # The MLflow / W&B runs the training logs to, recorded in the run's tags so that
        # the service's sinks log validated metrics there; None once recorded.
        self._trackers_to_record: dict[str, Any] | None = None
        self._trackers_seen: dict[str, Any] = {}
        # Called after each registration (the stop watcher looks at the registry again).
        self._registration_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------- made on use
    @property
    def settings(self) -> Settings:
        if self._settings is None:
            with self._settings_lock:  # its own: resolving may ask the service
                if self._settings is None:
                    self._settings = resolve_settings()
        return self._settings

    @property
    def storage(self) -> CheckpointStorage:
        if self._storage is None:
            settings = self.settings
            with self._lock:
                if self._storage is None:
                    self._storage = CheckpointStorage(
                        settings.resolved_storage(), settings.storage_options
                    )
        return self._storage

    @property
    def trust(self) -> PayloadTrust:
        """The key this reporter signs with and the modules its references may name."""
        if self._trust is None:
            self._trust = PayloadTrust.from_settings(self.settings)
        return self._trust

    @property
    def writer(self):
        """The reporter's registry writer (``ledger``, ``assemblies``), opened once."""
        return self._registry_side().writer

    @property
    def registry(self):
        """The users' Registry (queries, wait, stop decisions) over the writer's database."""
        writer = self.writer
        if self._registry is None:
            Registry = import_once("validation_service.registry.registry").Registry
            with self._lock:
                if self._registry is None:
                    self._registry = Registry.on_database(writer.db, self.settings)
        return self._registry

    @property
    def attempt(self) -> int:
        return self._registry_side().attempt

    def _registry_side(self) -> _Opened:
        """The writer, opened once on the set-up thread; waits for it. A registry that
        was unreachable is opened again by the next caller."""
        from validation_service.errors import RegistryUnavailable

        future = self._opening()
        try:
            return future.result()
        except RegistryUnavailable:
            with self._lock:
                if self._opened is future:
                    self._opened = None
            raise

    def _opening(self) -> Future:
        """The opening of the writer on the set-up thread, begun by the first caller."""
        with self._lock:
            if self._opened is None:
                self._opened = self._thread("set-up").submit(self._open_writer)
            return self._opened

    def _open_writer(self) -> _Opened:
        composition = import_once("validation_service.registry.composition")

        settings = self.settings
        writer = composition.open_report_writer(settings)
        try:
            # The run is created by its first report's index reservation (or by
            # ensure_run()): setting a reporter up writes nothing. A RUNNING run (restarted
            # workers) goes on; an ended one gets a new attempt at its first report, or
            # with CKVAL_APPEND is reopened then and continued. A later attempt (its report
            # indices start at 0 again) has its own folder in storage, "<run>/attempt-N":
            # known before the run's attempt exists.
            self._run_id, attempt = writer.ledger.reporting_attempt(
                self.run, append=settings.append
            )
            self._finish_stored_reports(writer.ledger, attempt)
        except BaseException:
            writer.close()
            raise
        return _Opened(writer, attempt)

    def _journal(self) -> ReportJournal | None:
        if not self.storage.is_local:
            return None  # only a local storage stages copies (storage.stage)
        return ReportJournal(self.storage, self.settings.namespace, self.run, self.trust)

    def _finish_stored_reports(self, ledger, attempt: int) -> list[int]:
        """Registers the SYNC reports that a process of this run stored and did not live
        to register (see _journal.py), before this process reserves an index."""
        journal = self._journal()
        if journal is None:
            return []

        def reserve() -> tuple[int, int]:
            return ledger.reserve_report_index(self._ensure_run_on(ledger)), attempt

        def register(index, persisted, metrics, job) -> None:
            run_id = self._ensure_run_on(ledger)
            self._register_on(ledger, run_id, index, persisted, metrics, job)

        return journal.recover(
            self.settings.delivery_timeout_s, reserve, register, self.settings.namespace, self.run
        )

    def _thread(self, name: str) -> ThreadPoolExecutor:
        with self._threads_lock:
            pool = self._threads.get(name)
            if pool is None:
                pool = self._threads[name] = ThreadPoolExecutor(
                    _THREADS[name], thread_name_prefix=f"ckval-{name}"
                )
                if name == "report":
                    atexit.register(self._flush_at_exit)
            return pool

    @property
    def run_id(self) -> int:
        return self.ensure_run()

    def ensure_run(self) -> int:
        """The run's id, creating the run in the registry if it is not there yet."""
        return self._ensure_run_on(self.writer.ledger)

    def _ensure_run_on(self, ledger) -> int:
        if self._run_id is None:
            root, append = self.storage.root_uri, self.settings.append
            with self._lock:
                if self._run_id is None:
                    self._run_id = ledger.ensure_run(self.run, storage_root=root, append=append)
        return self._run_id

    def prepare(self, *, with_service: bool = True) -> None:
        """Gets ready for a first report while training starts; writes nothing.

        Opens the registry writer and, ``with_service``, finds the service, starting it
        if none runs (the embedded default), so that its cold start overlaps training
        instead of following the first report; the service warms worker processes for
        the run's first validations meanwhile.
        """
        for name in _THREADS:
            self._thread(name).submit(lambda: None)
        self._opening()
        # The service's start (a new process, seconds on a fresh cluster) does not wait
        # for the registry to open: the two overlap.
        if with_service and self._link is not None:
            self._link.warm_up()
        self._registry_side()

    # -------------------------------------------------------------- reporting
    def reserve_index(self) -> int:
        """Reserves the report index of one report in the registry (creating the run).

        The registry hands each index out once, whichever process asks: any number of
        processes may report to one run, and their checkpoint folders never collide.
        One process's reports get increasing indices, in the order it reports them.
        """
        return self.writer.ledger.reserve_report_index(self.run_id)

    def scan(self, checkpoint) -> CheckpointFolder | None:
        """Lists a local checkpoint folder before its index is reserved (see
        storage.scan_folder), refusing one that cannot be stored; None if remote."""
        return scan_folder(checkpoint.path) if _is_local(checkpoint) else None

    def adopt(self, checkpoint) -> PersistedCheckpoint:
        """Registers a checkpoint already in ckval's storage where it is (NO_UPLOAD)."""
        uri = checkpoint.path if _is_local(checkpoint) else _uri_of(checkpoint)
        return self.storage.adopt(uri, self.settings.namespace, self.run)

    def report(self, report: PreparedReport, checkpoint) -> tuple[int, str]:
        """Persists and registers one checkpoint (with the report's metrics, validation
        request and upload mode); returns its report index and URI.

        SYNC and NO_UPLOAD return once it is registered (or, with the registry
        unreachable, once stored: the registration is retried in the background).
        ASYNC returns once its index is reserved: store_and_register(). Raises
        ReportNotDelivered first if an earlier report could not be delivered.
        """
        metrics, job, mode = report.metrics, report.job, report.mode
        if mode is CheckpointUploadMode.ASYNC:
            stored = self.store_and_register(
                metrics, checkpoint, job, delete_local=report.delete_local
            )
            return stored.index, stored.uri
        self.note_trackers()
        signed_request(job, self.trust)  # a reference not allowed: refused before any copy
        self._pending.raise_undelivered()
        # A checkpoint that cannot be stored is refused before an index is reserved.
        if mode is CheckpointUploadMode.SYNC:
            source = self.scan(checkpoint)
            index = self.reserve_index()
            persisted = self._store(checkpoint, index, report.delete_local, source)
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
        copy_now: bool = False,
    ) -> StoredReport:
        """Copies a checkpoint into storage and registers it, in the background.

        Returns after listing the checkpoint's folder (a checkpoint that is not a folder
        is refused here, before anything starts) or, with ``copy_now``, once ckval's copy
        is stored. The copy reads the folder, which is deleted once copied when
        ``delete_local``. The registration (and the validation's enqueueing) follows as
        soon as the copy is done, retried while the registry is unreachable. Raises
        ReportNotDelivered first if an earlier report could not be delivered.
        """
        import pyarrow.fs

        self.note_trackers()
        self._pending.raise_undelivered()
        info = checkpoint.filesystem.get_file_info(checkpoint.path)
        if info.type != pyarrow.fs.FileType.Directory:
            raise CheckpointNotFound(checkpoint.path, "the reported checkpoint is not a folder")
        source = self.scan(checkpoint)
        staged = self._stage(source) if copy_now else None
        record = None
        if staged is not None:  # acknowledged once this returns: durable from now on
            record = self._journal().write(staged, metrics, job)
        # Both threads take reports in order, so one process's indices follow its reports.
        reserved = self._thread("reserve").submit(self._reserve)
        stored = self._thread("store").submit(
            self._store_reserved, checkpoint, reserved, delete_local, source, record
        )

        def register() -> None:
            self._deliver(reserved.result()[0], stored.result(), metrics, job)
            if record is not None:
                self._journal().done(record)

        registered = self._in_background(reserved, register)
        if copy_now and staged is None:
            stored.result()  # remote storage: the copy goes straight to its index's folder
        return StoredReport(reserved, stored, registered)

    def _stage(self, source: CheckpointFolder | None) -> StagedCheckpoint | None:
        """ckval's copy of a local folder made now, before its index is known; None where
        the storage (or the checkpoint) is not local."""
        if source is None or not self.storage.is_local:
            return None
        return self.storage.stage(source, self.settings.namespace, self.run)

    def _reserve(self) -> tuple[int, str]:
        """reserve_index(), retried while the registry is unreachable (for up to
        delivery_timeout_s, as a registration is), and where the copy goes."""
        index = with_backoff(self.reserve_index, timeout_s=self.settings.delivery_timeout_s)
        return index, self._upload_uri(index)

    def _store_reserved(
        self,
        checkpoint,
        reserved: Future,
        delete_local: bool,
        source: CheckpointFolder | None,
        record: Record | None,
    ) -> PersistedCheckpoint:
        """Stores a checkpoint under its reserved index: a staged (and recorded) copy is
        renamed there; a local folder is copied while the index is reserved, then renamed."""
        if record is not None:
            # Training may have dropped its folder: on failure the copy and its record stay
            # for the next reporter of the run to finish.
            index = reserved.result()[0]
            self._journal().reserved(record, index, self.attempt)
            return self.storage.commit(
                record.staged, self.settings.namespace, self.run, index, self.attempt
            )
        staged = self._stage(source)
        if staged is None:
            return self._store(checkpoint, reserved.result()[0], delete_local, source)
        try:
            persisted = self.storage.commit(
                staged, self.settings.namespace, self.run, reserved.result()[0], self.attempt
            )
        except BaseException:
            self.storage.discard(staged)
            raise
        if delete_local:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        return persisted

    def _store(
        self, checkpoint, index: int, delete_local: bool, source: CheckpointFolder | None
    ) -> PersistedCheckpoint:
        namespace = self.settings.namespace
        if _is_local(checkpoint):
            persisted = self.storage.upload(
                source or checkpoint.path, namespace, self.run, index, attempt=self.attempt
            )
        else:
            with tempfile.TemporaryDirectory(prefix="ckval-upload-") as tmp:
                local = checkpoint.to_directory(tmp)
                persisted = self.storage.upload(
                    local, namespace, self.run, index, attempt=self.attempt
                )
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

    def register(
        self,
        index: int,
        persisted: PersistedCheckpoint,
        metrics: dict[str, Any],
        job: ValidationRequest | None,
        *,
        through: Callable[..., Any] | None = None,
    ):
        """Registers a stored checkpoint with its signed job; ``through``: the call that
        writes it, in place of the ledger's register_checkpoint (a sharded report's seal,
        Assemblies.seal, which takes the same arguments)."""
        return self._register_on(
            self.writer.ledger, self.run_id, index, persisted, metrics, job, through
        )

    def _register_on(self, ledger, run_id: int, index: int, persisted, metrics, job, through=None):
        self._record_trackers(ledger, run_id)
        binding = job_binding(self.settings.namespace, self.run, index, persisted.uri)
        job = signed_request(job, self.trust, binding)
        registration = (through or ledger.register_checkpoint)(
            run_id,
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
        for listener in list(self._registration_listeners):
            listener()
        return registration

    def after_registration(self, listener: Callable[[], None]) -> None:
        """Calls ``listener()`` (which must return at once) after each registration."""
        self._registration_listeners.append(listener)

    def _register_or_deliver(
        self, index: int, persisted: PersistedCheckpoint, metrics, job
    ) -> None:
        from validation_service.errors import RegistryUnavailable

        try:
            self.register(index, persisted, metrics, job)
        except RegistryUnavailable as exc:
            # The checkpoint is stored; the registry is unreachable for the moment.
            logger.warning(
                "registry unreachable (%s); report %d of run %r is delivered in the background",
                unavailable_reason(exc),
                index,
                self.run,
            )
            self._in_background(index, self._deliver, index, persisted, metrics, job)

    def _deliver(self, index: int, persisted: PersistedCheckpoint, metrics, job) -> None:
        """Registers with backoff until delivery_timeout_s; the registration is idempotent."""

        def say_retrying(exc: RegistryUnavailable) -> None:
            logger.warning(
                "registry unreachable (%s); report %d of run %r is retried in the background",
                unavailable_reason(exc),
                index,
                self.run,
            )

        with_backoff(
            lambda: self.register(index, persisted, metrics, job),
            timeout_s=self.settings.delivery_timeout_s,
            max_delay_s=15.0,
            on_first_retry=say_retrying,
        )

    def submit(self, thread: str, fn, *args) -> Future:
        """Runs ``fn`` on one of the reporter's threads (see _THREADS), in submission order."""
        return self._thread(thread).submit(fn, *args)

    def remember(self, index: int | Future, future: Future) -> None:
        """Makes flush() wait for ``future``, a report's delivery (see PendingReports.add)."""
        self._pending.add(index, future)

    def _in_background(self, index: int | Future, fn, *args) -> Future:
        """Runs ``fn`` on a background thread, remembered for flush() under ``index``
        (the report index, or the future of its reservation)."""
        future = self._thread("report").submit(fn, *args)
        self._pending.add(index, future)
        return future

    def note_trackers(self) -> None:
        """Notes the tracker runs active in the calling thread (report()'s) for the run."""
        trackers = active_trackers()
        if trackers and trackers != self._trackers_seen:
            with self._lock:
                self._trackers_seen = trackers
                self._trackers_to_record = trackers

    def _record_trackers(self, ledger, run_id: int) -> None:
        trackers = self._trackers_to_record
        if trackers is not None:
            ledger.tag_run(run_id, {TRACKERS_TAG: trackers})
            with self._lock:
                if self._trackers_to_record is trackers:
                    self._trackers_to_record = None

    def raise_undelivered(self) -> None:
        """Raises ReportNotDelivered for background reports that failed for good."""
        self._pending.raise_undelivered()

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits for background uploads and deliveries; raises if one failed."""
        self._pending.flush(timeout_s)

    def _flush_at_exit(self) -> None:
        from trainer_integration._delivery import ReportNotDelivered

        try:
            self.flush(self.settings.delivery_timeout_s)
        except ReportNotDelivered as exc:
            logger.error("%s", exc)

    def close(self) -> None:
        """Stops the threads and closes the registry writer of a reporter that is done
        (after flush(): deliveries still under way are not waited for); a Registry made
        on it goes with it."""
        with self._threads_lock:
            pools, self._threads = list(self._threads.values()), {}
        for pool in pools:
            pool.shutdown(wait=False)
        opened = self._opened
        if opened is not None and opened.done() and opened.exception() is None:
            opened.result().writer.close()

    def nudge(self) -> None:
        """Tells the service there is new work (best effort: it also polls)."""
        if self._link is not None:
            self._link.nudge()


def _is_local(checkpoint) -> bool:
    import pyarrow.fs

    return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)


def _uri_of(checkpoint) -> str:
    type_name = checkpoint.filesystem.type_name
    return f"{type_name}://{checkpoint.path}"
