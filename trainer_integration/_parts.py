"""Checkpoints that several ranks write (FSDP, DeepSpeed, torch.distributed.checkpoint):
each rank's report() stores its own folder as one part of the report's checkpoint, and
the lowest rank seals the checkpoint once every rank's part is stored.

The ranks of one report agree on it without waiting for each other: each counts its
report() calls (every rank calls report() at the same points, as Ray Train requires),
and the worker group has a key that rank 0 broadcasts once, on Ray Train's upload
thread after the first report. Sealing happens on
Ray Train's upload thread inside the ranks' ``ray.train.report`` of that report, after
Ray Train's own rank sync: by then every rank has stored its part (each stores it before
entering that call).
"""

from __future__ import annotations

import dataclasses
import posixpath
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import Future

from trainer_integration._delivery import with_backoff
from trainer_integration._imports import import_once
from trainer_integration._rank_files import file_rank
from trainer_integration._reporter import _is_local, _uri_of
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from validation_service.errors import CkvalError, InvalidInput
from validation_service.jobs import AssemblyStatus
from validation_service.manifest import scan_folder
from validation_service.payloads import signed_request
from validation_service.request import ValidationRequest

_groups: dict[tuple[str, int], _Calls] = {}  # (run, rank) -> this worker's report() calls
_groups_lock = threading.Lock()


class _Calls:
    """One rank's report() calls in one worker group, and the group's key."""

    def __init__(self):
        self.group: Future = Future()  # rank 0's key, once the ranks have agreed on it
        self.count = 0


@dataclasses.dataclass(frozen=True)
class ReportKey:
    """One report() call of a worker group: the same on every rank."""

    group: Future
    call: int

    def result(self) -> str:
        """``<worker group>-<call>``; waits for the ranks to agree on the group."""
        return f"{self.group.result()}-{self.call}"


def next_report_key(context, line) -> ReportKey:
    """The key of this report() call, the same on every rank of the worker group.

    At its first report() each rank takes rank 0's worker group key from a broadcast on
    Ray Train's upload thread, in line with Ray Train's own collectives of its reports:
    the training thread never waits for the other ranks (without that thread, another
    Ray, it does, once).
    """
    slot = (context.get_experiment_name(), context.get_world_rank())
    with _groups_lock:
        calls = _groups.get(slot)
        first = calls is None
        if first:
            calls = _groups[slot] = _Calls()
        calls.count += 1
        key = ReportKey(calls.group, calls.count)
    if first:
        if line is None:
            _agree_on_group(calls.group)
        else:
            line.submit(lambda: _agree_on_group(calls.group))
    return key


def _agree_on_group(group: Future) -> None:
    from ray.train.collective import broadcast_from_rank_zero

    try:
        group.set_result(broadcast_from_rank_zero(uuid.uuid4().hex[:16]))
    except BaseException as exc:
        group.set_exception(exc)
        raise


@dataclasses.dataclass(frozen=True)
class ShardReport:
    """One rank's part of one report, on its way into storage and the registry."""

    rank: int
    key: ReportKey
    joined: Future  # of the Slot: report index, checkpoint URI, assembly id
    registered: Future  # of the Slot, once this rank's part is stored and recorded
    mode: CheckpointUploadMode
    job: ValidationRequest | None
    location: str | None  # the folder a NO_UPLOAD part is registered in place

    @property
    def uri(self) -> str:
        """Where the checkpoint is (once the part is recorded)."""
        return self.location or self.registered.result().uri


class ShardReporter:
    """Stores one rank's parts of a run's checkpoints and seals those it is lowest in."""

    def __init__(self, reporter, rank: int):
        self.reporter = reporter
        self.rank = rank

    def report(self, report: PreparedReport, checkpoint, key: ReportKey) -> ShardReport:
        """Starts storing this rank's folder as its part of the report ``key`` (with the
        report's metrics, validation request and upload mode).

        Returns once the folder is listed (ASYNC), once this rank's copy is stored
        (SYNC; with remote storage once its part is recorded). NO_UPLOAD registers no
        copy: the part is recorded in the background. A folder that cannot be stored is
        refused first, naming the rank.
        """
        reporter, job, mode = self.reporter, report.job, report.mode
        reporter.note_trackers()
        signed_request(job, reporter.trust)  # a reference not allowed: refused before any copy
        reporter.raise_undelivered()
        location = _path_of(checkpoint) if mode is CheckpointUploadMode.NO_UPLOAD else None
        source = None if location is not None else self._scan(checkpoint)
        staged = None
        if mode is CheckpointUploadMode.SYNC and source is not None and reporter.storage.is_local:
            staged = reporter.storage.stage(source, reporter.settings.namespace, reporter.run)
        joined = reporter.submit("reserve", self._join, key)
        registered = reporter.submit(
            "store", self._store, joined, checkpoint, source, staged, location, report.metrics
        )
        if report.delete_local and location is None and _is_local(checkpoint):
            registered.add_done_callback(lambda f: _drop_if_stored(f, checkpoint.path))
        reporter.remember(joined, registered)
        if mode is CheckpointUploadMode.SYNC and staged is None:
            registered.result()  # remote storage: stored when report() returns
        return ShardReport(self.rank, key, joined, registered, mode, job, location)

    def _scan(self, checkpoint):
        if not _is_local(checkpoint):
            return None  # a remote folder: downloaded by the storing thread
        try:
            source = scan_folder(checkpoint.path)
        except CkvalError as exc:  # its own type, saying which rank's folder it is
            exc.args = (
                f"report() on rank {self.rank}: {exc} Pass Checkpoint.from_directory(d) of a "
                "folder this rank wrote and can read; nothing of this report was stored.",
            )
            raise
        except OSError as exc:
            raise InvalidInput(
                f"report() on rank {self.rank}: its checkpoint folder {checkpoint.path!r} "
                f"cannot be read ({exc}). Pass Checkpoint.from_directory(d) of a folder "
                "this rank wrote and can read; nothing of this report was stored."
            ) from None
        import_once("validation_service.parts").check_part_names(source, self.rank)
        return source

    def _join(self, key: ReportKey):
        reporter = self.reporter
        storage, settings = reporter.storage, reporter.settings

        def uri_of(index: int) -> str:
            path = storage.checkpoint_path(
                settings.namespace, reporter.run, index, attempt=reporter.attempt
            )
            return storage.uri_for(path)

        group_key = key.result()
        return with_backoff(
            lambda: reporter.writer.assemblies.join(reporter.run_id, group_key, uri_of),
            timeout_s=settings.delivery_timeout_s,
        )

    def _store(self, joined, checkpoint, source, staged, location, metrics):
        # The slot first: it was joined through the registry that the set-up thread
        # opened, importing SQLAlchemy. Importing it on two threads at once can meet its
        # modules half made (a circular import), so this thread imports none before.
        slot = joined.result()
        PartRecord = import_once("validation_service.registry.assemblies").PartRecord

        reporter = self.reporter
        storage = reporter.storage
        if location is not None:
            files = self._hash_own_files(location)
            size = sum(entry["size"] for entry in files.values())
            part = PartRecord(self.rank, location, files, size, metrics)
        else:
            try:
                path, files = self._store_files(storage, slot, checkpoint, source, staged)
            except BaseException:
                if staged is not None:
                    storage.discard(staged)
                raise
            size = sum(entry["size"] for entry in files.values())
            part = PartRecord(self.rank, storage.uri_for(path), files, size, metrics)
        with_backoff(
            lambda: reporter.writer.assemblies.add_part(slot.assembly_id, part),
            timeout_s=reporter.settings.delivery_timeout_s,
        )
        return slot

    def _hash_own_files(self, location: str) -> dict:
        """NO_UPLOAD: this rank hashes its own shards of the folder every rank wrote
        into (named for it, as torch.distributed.checkpoint and DeepSpeed name them);
        the sealer hashes the rest (metadata, configs: perhaps written by every rank)
        once every rank has reported."""
        hash_own_files = import_once("validation_service.parts").hash_own_files

        reporter = self.reporter

        def owns(rel: str) -> bool:
            return file_rank(posixpath.basename(rel)) == self.rank

        return hash_own_files(
            reporter.storage, location, reporter.settings.namespace, reporter.run, owns
        )

    def _store_files(self, storage, slot, checkpoint, source, staged):
        store_part = import_once("validation_service.parts").store_part

        target = storage.path_of(slot.uri)
        if source is not None:
            return store_part(storage, target, self.rank, source, staged)
        with tempfile.TemporaryDirectory(prefix="ckval-part-") as tmp:
            local = checkpoint.to_directory(tmp)
            return store_part(storage, target, self.rank, scan_folder(local))

    def seal(self, shard: ShardReport) -> bool:
        """Makes the report's parts one checkpoint and registers it with its validation,
        if this rank is the lowest that stored a part; call it once every rank that
        reports in this step has stored its part. Returns whether this rank sealed it."""
        parts_module = import_once("validation_service.parts")
        adopt_shared, assemble = parts_module.adopt_shared, parts_module.assemble

        reporter = self.reporter
        slot = shard.registered.result()
        assemblies = reporter.writer.assemblies
        parts = assemblies.parts(slot.assembly_id)
        if not parts or parts[0].rank != self.rank:
            return False
        parts = assemblies.begin_sealing(slot.assembly_id)
        if parts is None:
            return False
        storage, settings = reporter.storage, reporter.settings
        try:
            if shard.mode is CheckpointUploadMode.NO_UPLOAD:
                persisted = adopt_shared(storage, parts, settings.namespace, reporter.run)
                conflicts = []
            else:
                target = storage.path_of(slot.uri)
                persisted, conflicts = assemble(storage, target, parts, settings.shard_conflicts)
            with_backoff(
                lambda: reporter.register(
                    slot.report_index, persisted, parts[0].reported_metrics, shard.job
                ),
                timeout_s=settings.delivery_timeout_s,
            )
        except BaseException as exc:
            assemblies.end(slot.assembly_id, AssemblyStatus.INCOMPLETE, f"sealing failed: {exc}")
            raise
        detail = "; ".join(str(c) for c in conflicts) or None
        assemblies.end(slot.assembly_id, AssemblyStatus.COMPLETE, detail)
        assemblies.give_up_other_groups(reporter.run_id, f"{shard.key.group.result()}-")
        return True


def _drop_if_stored(stored: Future, path: str) -> None:
    """Deletes the rank's folder once its part is stored (as Ray Train's
    delete_local_checkpoint_after_upload does); a failed copy keeps it."""
    if stored.exception() is None:
        shutil.rmtree(path, ignore_errors=True)


def _path_of(checkpoint) -> str:
    return checkpoint.path if _is_local(checkpoint) else _uri_of(checkpoint)
