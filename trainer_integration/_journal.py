"""Records that keep a SYNC report durable from the moment its copy is stored.

A SYNC report inside Ray Train returns once ckval's copy is stored, before its report
index is reserved (the registry may still be opening). Beside the staged copy
``<run>/.staging-<id>/`` it writes ``<run>/.staging-<id>.report.json``: the report's
metrics and signed validation request, and who wrote it. The record is updated with the
index and attempt once reserved, and deleted once the checkpoint is registered. If the
process dies in between (a train function that raises right after its report, a lost
node), the next reporter of the run, or RunStatusCallback when the run ends, finds the
record and finishes the report: index, rename, registration (idempotent per index).

A record is taken over only from a writer that is gone: a process of this machine that
no longer runs, or a record older than CKVAL_DELIVERY_TIMEOUT_S (its writer gave up). It
holds the validate_fn as pickled bytes, so the whole record is signed with the reporting
key, bound to its run (signing.REPORT_RECORD): a record that does not verify is never
read, let alone unpickled or signed for a job.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from validation_service.errors import PayloadSignatureError
from validation_service.request import ValidationRequest
from validation_service.signing import REPORT_RECORD, PayloadTrust
from validation_service.storage import (
    CheckpointStorage,
    PersistedCheckpoint,
    StagedCheckpoint,
)

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".report.json"
_BYTES_FIELDS = ("validate_fn_pickle", "validate_config")


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone, or no psutil: unknown
        return None


def _writer() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _process_started(pid)}


def _writer_gone(writer: dict[str, Any]) -> bool:
    """Whether the process that wrote a record is known to have ended: it ran on this
    machine and no longer does (or its pid now belongs to a later process)."""
    if writer.get("host") != socket.gethostname():
        return False
    pid = int(writer.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    started = _process_started(pid)
    return started is not None and writer.get("started") not in (None, started)


@dataclasses.dataclass
class Record:
    """One SYNC report written to storage but not yet registered."""

    path: str  # the record file
    staged: StagedCheckpoint
    metrics: dict[str, Any]
    job: ValidationRequest | None
    report_index: int | None = None
    attempt: int | None = None


class ReportJournal:
    """The records of one run's folder in local storage."""

    def __init__(self, storage: CheckpointStorage, namespace: str, run: str, trust: PayloadTrust):
        self.storage = storage
        self.folder = storage.run_folder(namespace, run)
        self.trust = trust
        self._binding = json.dumps([namespace, run]).encode()

    def write(
        self, staged: StagedCheckpoint, metrics: dict[str, Any], job: ValidationRequest | None
    ) -> Record:
        """Writes the record of a staged copy (``job``: already signed)."""
        record = Record(staged.path + RECORD_SUFFIX, staged, metrics, job)
        self._save(record, created_at=time.time())
        return record

    def reserved(self, record: Record, index: int, attempt: int) -> None:
        """Notes the report's index and attempt, before the copy is renamed to them."""
        record.report_index, record.attempt = index, attempt
        self._save(record, created_at=time.time())

    def done(self, record: Record) -> None:
        try:
            os.remove(record.path)
        except FileNotFoundError:
            pass

    def _save(self, record: Record, created_at: float) -> None:
        job = None
        if record.job is not None:
            job = dataclasses.asdict(record.job)
            for name in _BYTES_FIELDS:
                if job[name] is not None:
                    job[name] = base64.b64encode(job[name]).decode()
        body = {
            "version": 1,
            "staged": os.path.basename(record.staged.path),
            "files": record.staged.files,
            "manifest": base64.b64encode(record.staged.manifest).decode(),
            "metrics": record.metrics,
            "job": job,
            "report_index": record.report_index,
            "attempt": record.attempt,
            "writer": _writer(),
            "created_at": created_at,
        }
        signed = self.trust.sign(REPORT_RECORD, json.dumps(body).encode(), bound_to=self._binding)
        partial = f"{record.path}.{uuid.uuid4().hex}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signed)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, record.path)

    def _read(self, path: str) -> dict[str, Any] | None:
        """A record's body, once its signature verifies; None (logged) otherwise."""
        try:
            with open(path, "rb") as f:
                data = f.read()
            return json.loads(self.trust.verify(REPORT_RECORD, data, bound_to=self._binding))
        except PayloadSignatureError as exc:
            logger.error("report record %s is not trusted, left as it is: %s", path, exc)
        except (OSError, ValueError):
            logger.debug("report record %s unreadable", path, exc_info=True)
        return None

    def orphans(self, stale_after_s: float) -> list[Record]:
        """Records whose writer is gone, each taken (renamed) by this process first, so
        that two processes never finish the same report."""
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:  # no run folder yet (or no folder at all: storing says why)
            return []
        taken = []
        for name in names:
            if not (name.startswith(".staging-") and name.endswith(RECORD_SUFFIX)):
                continue
            path = os.path.join(self.folder, name)
            body = self._read(path)
            if body is None:
                continue
            stale = time.time() - body["created_at"] > stale_after_s
            if not (stale or _writer_gone(body["writer"])):
                continue
            # Taken by renaming it: of two processes, one wins; the record then names
            # this process as its writer, so that no third one takes it meanwhile.
            taken_path = os.path.join(self.folder, f"{body['staged']}-{uuid.uuid4().hex[:8]}")
            taken_path += RECORD_SUFFIX
            try:
                os.rename(path, taken_path)
            except FileNotFoundError:
                continue
            record = _loaded(taken_path, body)
            self._save(record, created_at=body["created_at"])
            taken.append(record)
        return taken

    def recover(
        self,
        stale_after_s: float,
        reserve: Callable[[], tuple[int, int]],
        register: Callable[[int, PersistedCheckpoint, dict, ValidationRequest | None], Any],
        namespace: str,
        run: str,
    ) -> list[int]:
        """Finishes the reports of gone writers: reserves an index (``reserve`` returns
        it with the attempt) where none was, renames the copy, registers it. Returns the
        report indices finished."""
        finished = []
        for record in self.orphans(stale_after_s):
            try:
                if record.report_index is None:
                    self.reserved(record, *reserve())
                persisted = self._committed(record, namespace, run)
                register(record.report_index, persisted, record.metrics, record.job)
            except Exception:  # noqa: BLE001 - left for the next reporter; say why
                logger.exception("could not finish stored report %s of run %r", record.path, run)
                continue
            self.done(record)
            finished.append(record.report_index)
            logger.warning(
                "registered report %d of run %r, which a process that ended had stored",
                record.report_index,
                run,
            )
        return finished

    def _committed(self, record: Record, namespace: str, run: str) -> PersistedCheckpoint:
        assert record.report_index is not None and record.attempt is not None
        if os.path.isdir(record.staged.path):
            return self.storage.commit(
                record.staged, namespace, run, record.report_index, record.attempt
            )
        # Renamed before its writer ended: it is at its index's folder already.
        path = self.storage.checkpoint_path(
            namespace, run, record.report_index, attempt=record.attempt
        )
        return self.storage.persisted(path, record.staged.files, record.staged.manifest)


def _loaded(path: str, body: dict[str, Any]) -> Record:
    job = body.get("job")
    if job is not None:
        for name in _BYTES_FIELDS:
            if job[name] is not None:
                job[name] = base64.b64decode(job[name])
        job = ValidationRequest(**job)
    staged = StagedCheckpoint(
        os.path.join(os.path.dirname(path), body["staged"]),
        body["files"],
        base64.b64decode(body["manifest"]),
    )
    return Record(path, staged, body["metrics"], job, body["report_index"], body["attempt"])
