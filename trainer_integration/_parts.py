"""Reports of a worker group of several ranks: each rank's checkpoint folder (if any) is
its part of the report's checkpoint, sealed once every rank has reported past the call.

The ranks of one report agree on it without talking to each other: each counts its own
report() calls (every rank calls report() at the same points, as Ray Train requires),
and the worker group has a key each rank finds by itself (Ray Train's placement group of
the group's workers; torchrun's run under Ray Train's local mode). Each rank moves its
progress on in the registry at every call, and a rank with a folder joins the call's
assembly first (registry/assemblies.py); then it stores its part on the reporter's
threads, and the lowest rank with a part seals the checkpoint once no rank is behind and
every joined part is stored, or ends it INCOMPLETE when a part failed. No collective of
Ray Train or torch.distributed is ever entered: those belong to the training code.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future

from trainer_integration._delivery import with_backoff
from trainer_integration._imports import import_once
from trainer_integration._rank_files import file_rank
from trainer_integration._request import CheckpointUploadMode, PreparedReport
from validation_service import parts as parts_module
from validation_service.errors import CkvalError, InvalidInput
from validation_service.jobs import AssemblyStatus, PartStatus
from validation_service.manifest import scan_folder
from validation_service.payloads import signed_request

# The longest pause between two looks at an assembly that waits for other ranks.
MAX_SETTLE_PAUSE_S = 0.25

_calls: dict[tuple[str, int], int] = {}  # (worker group, rank) -> report() calls so far
_calls_lock = threading.Lock()


def report_call(context):
    """This rank's next report() call in its worker group (a ReportCall): the same key on
    every rank of the group for the same call, found without a collective."""
    # A plain record (no SQLAlchemy): imported without import_once's lock, which a
    # reporter thread may hold while it imports the registry.
    from validation_service.registry.records import ReportCall

    rank, world_size = context.get_world_rank(), context.get_world_size()
    group = worker_group(context)
    with _calls_lock:
        call = _calls[(group, rank)] = _calls.get((group, rank), 0) + 1
    return ReportCall(group, call, rank, world_size)


def worker_group(context) -> str:
    """The key of this rank's worker group, the same on each of its ranks and new for a
    restarted group: Ray Train runs each group's workers in a placement group of its
    own; in Ray Train's local mode under torchrun, the launch (_torchrun_launch)."""
    import ray

    if ray.is_initialized():
        group = ray.get_runtime_context().get_placement_group_id()
        if group:
            return f"pg{group}"
    launch = _torchrun_launch()
    if launch is not None:
        return launch
    raise InvalidInput(
        f"report() on rank {context.get_world_rank()} of {context.get_world_size()}: ckval "
        "cannot tell which processes report together here (no Ray Train worker group, and "
        "no torchrun launch it can name on every node). Run under Ray Train "
        "(ScalingConfig(num_workers=N)) or, in Ray Train's local mode, launch the ranks "
        "with `torchrun --standalone` (one node) or `--rdzv-id=<a new id per launch>`; "
        "nothing was stored."
    )


def _torchrun_launch() -> str | None:
    """One torchrun launch, named alike in each of its processes: its rendezvous id and
    restart count when the launch named one (``--rdzv-id``; ``--standalone`` makes one
    up), else, on one node, the torchrun agent that started every rank (its pid and
    start time: a later launch of the same command is another). None outside torchrun,
    or for several nodes without a rendezvous id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if run_id != "none":
        return f"torchrun-{run_id}-{restart}"[:120]
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return None
    agent = os.getppid()
    try:
        import psutil

        started = int(psutil.Process(agent).create_time() * 1000)
    except Exception:  # noqa: BLE001 - the agent's pid alone, then
        started = 0
    return f"torchrun-agent-{agent}-{started}-{restart}"


@dataclasses.dataclass(frozen=True)
class Sealed:
    """The outcome of one report for the rank that tells Ray Train of it: the report's
    index and folder, and whether it became a checkpoint (or ended INCOMPLETE)."""

    report_index: int
    uri: str
    complete: bool
    detail: str | None = None


@dataclasses.dataclass(frozen=True)
class PartReport:
    """One rank's part of one report on its way: ``sealed`` gives a Sealed to the rank
    that seals it, None to the others."""

    rank: int
    sealed: Future
    joined: Future  # the report's Slot (index, folder, assembly), once this rank joined


class ShardReporter:
    """Stores one rank's parts of a run's reports and seals those it is lowest in."""

    def __init__(self, reporter, rank: int):
        self.reporter = reporter
        self.rank = rank

    def no_part(self, call) -> None:
        """A report() call without a checkpoint: the rank's progress moves on, in the
        background and in report order (a later part of this rank waits for it)."""
        reporter = self.reporter
        future = reporter.submit("reserve", self._advance, call)
        reporter.remember(future, future)

    def report(self, report: PreparedReport, checkpoint, call) -> PartReport:
        """Starts storing this rank's folder as its part of the report ``call``.

        Returns once the folder is listed (ASYNC) or this rank's copy is stored (SYNC;
        with remote storage once its part is recorded). NO_UPLOAD registers no copy. A
        folder that cannot be stored is refused here, naming the rank, and its part is
        recorded as failed: the report never becomes a checkpoint.
        """
        reporter, mode = self.reporter, report.mode
        reporter.note_trackers()
        signed_request(report.job, reporter.trust)  # a reference not allowed: refused first
        reporter.raise_undelivered()
        location = _path_of(checkpoint) if mode is CheckpointUploadMode.NO_UPLOAD else None
        try:
            source = None if location is not None else self._scan(checkpoint)
        except CkvalError as exc:
            self._fail(call, report.metrics, str(exc))
            raise
        staged = None
        if mode is CheckpointUploadMode.SYNC and source is not None and reporter.storage.is_local:
            staged = reporter.storage.stage(source, reporter.settings.namespace, reporter.run)
        joined = reporter.submit("reserve", self._join, call)
        stored = reporter.submit(
            "store", self._store, joined, checkpoint, source, staged, location, report.metrics
        )
        sealed = reporter.submit("seal", self._seal_when_settled, stored, call, report)
        if report.delete_local and location is None and _is_local(checkpoint):
            stored.add_done_callback(lambda f: _drop_if_stored(f, checkpoint.path))
        reporter.remember(joined, sealed)
        if mode is CheckpointUploadMode.SYNC and staged is None:
            stored.result()  # remote storage: stored when report() returns
        return PartReport(self.rank, sealed, joined)

    # ------------------------------------------------------------- the threads
    def _advance(self, call) -> None:
        reporter = self.reporter
        with_backoff(
            lambda: reporter.writer.assemblies.advance(reporter.run_id, call),
            timeout_s=reporter.settings.delivery_timeout_s,
        )

    def _join(self, call):
        reporter = self.reporter
        storage, settings = reporter.storage, reporter.settings

        def uri_of(index: int) -> str:
            path = storage.checkpoint_path(
                settings.namespace, reporter.run, index, attempt=reporter.attempt
            )
            return storage.uri_for(path)

        return with_backoff(
            lambda: reporter.writer.assemblies.join(reporter.run_id, call, uri_of),
            timeout_s=settings.delivery_timeout_s,
        )

    def _fail(self, call, metrics, detail: str) -> None:
        """Records this rank's part of ``call`` as failed, in the background."""
        PartRecord = import_once("validation_service.registry.assemblies").PartRecord
        reporter = self.reporter
        joined = reporter.submit("reserve", self._join, call)

        def record() -> None:
            part = PartRecord.failed(self.rank, metrics, f"rank {self.rank}: {detail}")
            self._arrive_failed(joined.result().assembly_id, part)

        future = reporter.submit("store", record)
        reporter.remember(joined, future)

    def _arrive_failed(self, assembly_id: int, part) -> None:
        """Records a failed part and ends its report INCOMPLETE at once: it can never be
        complete, and no rank may be left to end it (when no rank stored a part, none
        seals). No sealer began: a seal waits for every joined part to arrive."""
        assemblies = self.reporter.writer.assemblies
        if assemblies.arrive(assembly_id, part):
            assemblies.end(
                assembly_id, AssemblyStatus.INCOMPLETE, f"a rank's part failed: {part.detail}"
            )

    def _store(self, joined, checkpoint, source, staged, location, metrics):
        # The slot first: it was joined through the registry that the set-up thread
        # opened, importing SQLAlchemy. Importing it on two threads at once can meet its
        # modules half made (a circular import), so this thread imports none before.
        slot = joined.result()
        PartRecord = import_once("validation_service.registry.assemblies").PartRecord

        reporter = self.reporter
        storage = reporter.storage
        try:
            if location is not None:
                files = self._hash_own_files(location)
            else:
                path, files = self._store_files(storage, slot, checkpoint, source, staged)
                location = storage.uri_for(path)
        except BaseException as exc:
            if staged is not None:
                storage.discard(staged)
            failed = PartRecord.failed(self.rank, metrics, f"rank {self.rank}: {exc}")
            self._arrive_failed(slot.assembly_id, failed)
            raise
        size = sum(entry["size"] for entry in files.values())
        part = PartRecord(self.rank, location, files, size, metrics)
        with_backoff(
            lambda: reporter.writer.assemblies.arrive(slot.assembly_id, part),
            timeout_s=reporter.settings.delivery_timeout_s,
        )
        return slot

    def _hash_own_files(self, location: str) -> dict:
        """NO_UPLOAD: this rank hashes its own shards of the folder every rank wrote
        into (named for it, as torch.distributed.checkpoint and DeepSpeed name them);
        the sealer hashes the rest (metadata, configs: perhaps written by every rank)
        once every rank has reported."""
        reporter = self.reporter

        def owns(rel: str) -> bool:
            return file_rank(posixpath.basename(rel)) == self.rank

        return parts_module.hash_own_files(
            reporter.storage, location, reporter.settings.namespace, reporter.run, owns
        )

    def _store_files(self, storage, slot, checkpoint, source, staged):
        target = storage.path_of(slot.uri)
        if source is not None:
            return parts_module.store_part(storage, target, self.rank, source, staged)
        with tempfile.TemporaryDirectory(prefix="ckval-part-") as tmp:
            local = checkpoint.to_directory(tmp)
            return parts_module.store_part(storage, target, self.rank, scan_folder(local))

    def _seal_when_settled(self, stored: Future, call, report: PreparedReport) -> Sealed | None:
        """Once every rank reported past ``call`` and every joined part arrived: seals the
        checkpoint if this rank is the lowest with a stored part, or ends it INCOMPLETE
        when a part failed. Returns the outcome to the rank that tells Ray Train of it
        (the lowest with a stored part), None to the others."""
        slot = stored.result()
        standing = self._settled(slot, call)
        if standing.status is AssemblyStatus.INCOMPLETE:
            # Ended (a failed part ends it at once; gc may give it up): its parts stay as
            # they are. The lowest rank with a stored part tells Ray Train; with none, the
            # lowest whose part was still arriving (its arrival refused once it ended).
            tellers = standing.stored or [
                p for p in standing.parts if p.status is PartStatus.PENDING
            ]
            if not tellers or tellers[0].rank != self.rank:
                return None
            detail = _incomplete_reason(standing, call) if standing.failed else None
            return Sealed(
                slot.report_index, slot.uri, False, detail or "the report ended without it"
            )
        stored_parts = standing.stored
        if not stored_parts or stored_parts[0].rank != self.rank:
            return None  # another rank seals, and tells Ray Train
        if standing.status is not AssemblyStatus.ASSEMBLING:
            return Sealed(slot.report_index, slot.uri, False, "the report ended without it")
        if standing.failed or standing.behind:
            detail = _incomplete_reason(standing, call)
            self.reporter.writer.assemblies.end(slot.assembly_id, AssemblyStatus.INCOMPLETE, detail)
            return Sealed(slot.report_index, slot.uri, False, detail)
        # The checkpoint keeps the metrics of the lowest rank that reported them.
        metrics = standing.parts[0].reported_metrics if standing.parts else report.metrics
        return self._seal(slot, call, report.mode, report.job, metrics)

    def _settled(self, slot, call):
        """The assembly once settled, looked at with growing pauses (other ranks' rows
        arrive within milliseconds of their report() calls); given up after the delivery
        timeout, when a rank never reported past the call."""
        assemblies = self.reporter.writer.assemblies
        deadline = time.monotonic() + self.reporter.settings.delivery_timeout_s
        pause = 0.005
        while True:
            standing = assemblies.standing(self.reporter.run_id, slot.assembly_id, call)
            if standing.settled or standing.status is not AssemblyStatus.ASSEMBLING:
                return standing
            if time.monotonic() + pause > deadline:
                return standing  # a rank never came: the caller ends it INCOMPLETE
            time.sleep(pause)
            pause = min(pause * 2, MAX_SETTLE_PAUSE_S)

    def _seal(self, slot, call, mode, job, metrics) -> Sealed:
        """Makes the parts one checkpoint and registers it with its validation."""
        reporter = self.reporter
        assemblies = reporter.writer.assemblies
        parts = assemblies.begin_sealing(slot.assembly_id)
        if parts is None:
            return Sealed(slot.report_index, slot.uri, False, "another rank ended it")
        storage, settings = reporter.storage, reporter.settings
        try:
            if mode is CheckpointUploadMode.NO_UPLOAD:
                persisted = parts_module.adopt_shared(
                    storage, parts, settings.namespace, reporter.run
                )
                conflicts = []
            else:
                target = storage.path_of(slot.uri)
                persisted, conflicts = parts_module.assemble(
                    storage, target, parts, settings.shard_conflicts
                )
            # One transaction registers the checkpoint and ends the assembly COMPLETE (and
            # older groups' open ones INCOMPLETE); refused if it was given up meanwhile.
            detail = "; ".join(str(c) for c in conflicts) or None
            sealing = functools.partial(
                assemblies.seal,
                slot.assembly_id,
                detail=detail,
                group_prefix=f"{call.worker_group}-",
            )
            with_backoff(
                lambda: reporter.register(
                    slot.report_index, persisted, metrics, job, through=sealing
                ),
                timeout_s=settings.delivery_timeout_s,
            )
        except BaseException as exc:
            assemblies.end(slot.assembly_id, AssemblyStatus.INCOMPLETE, f"sealing failed: {exc}")
            raise
        return Sealed(slot.report_index, persisted.uri, True, detail)

    def _scan(self, checkpoint):
        if not _is_local(checkpoint):
            return None  # a remote folder: downloaded by the storing thread
        try:
            source = scan_folder(checkpoint.path)
        except CkvalError as exc:  # its own type, saying which rank's folder it is
            exc.args = (
                f"report() on rank {self.rank}: {exc} Pass Checkpoint.from_directory(d) of a "
                "folder this rank wrote and can read; this report's checkpoint is left "
                "INCOMPLETE on every rank.",
            )
            raise
        except OSError as exc:
            raise InvalidInput(
                f"report() on rank {self.rank}: its checkpoint folder {checkpoint.path!r} "
                f"cannot be read ({exc}). Pass Checkpoint.from_directory(d) of a folder "
                "this rank wrote and can read; this report's checkpoint is left INCOMPLETE "
                "on every rank."
            ) from None
        parts_module.check_part_names(source, self.rank)
        return source


def _incomplete_reason(standing, call) -> str:
    if standing.failed:
        return "a rank's part failed: " + "; ".join(p.detail or "" for p in standing.failed)
    return (
        f"rank(s) {standing.behind} never reported call {call.call} of the worker group "
        "within CKVAL_DELIVERY_TIMEOUT_S"
    )


def _drop_if_stored(stored: Future, path: str) -> None:
    """Deletes the rank's folder once its part is stored (as Ray Train's
    delete_local_checkpoint_after_upload does); a failed copy keeps it."""
    if stored.exception() is None:
        shutil.rmtree(path, ignore_errors=True)


def _is_local(checkpoint) -> bool:
    import pyarrow.fs

    return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)


def _path_of(checkpoint) -> str:
    if _is_local(checkpoint):
        return checkpoint.path
    return f"{checkpoint.filesystem.type_name}://{checkpoint.path}"
