"""One checkpoint from several ranks' folders: each rank's part stored in the report's
folder by that rank alone, and the parts sealed into one checkpoint folder.

Every byte is written once. On local storage a rank's copy (staged, hashed as it was
copied) is renamed to ``<checkpoint folder>/.ckval-part-<rank>/``, and sealing renames
each part's files up into the checkpoint folder (never over a file). On object storage
(S3, any fsspec URI) there is no rename, only copy and delete: each rank writes its files
straight to their final place in the checkpoint folder, and sealing writes the manifest.
No rank reads or sends another rank's bytes.

Two ranks with the same relative file: identical content is kept once. Different
content keeps one rank's file, with a warning, or fails the seal when
``CKVAL_SHARD_CONFLICTS=error``: the lowest rank's on local storage; on object storage
the one the storage holds (the last written: both went to the same place), found by
its digest. A file of one rank where another rank has a folder keeps the lowest rank's
the same way. A name under ``.ckval-part-`` is ckval's own and refused in a rank's folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from validation_service._home import make_private_folders
from validation_service.errors import InvalidInput
from validation_service.manifest import (
    MANIFEST_NAME,
    CheckpointFolder,
    StagedCheckpoint,
    algorithm_of,
    copy_file,
    copy_hashing,
    same_content,
)
from validation_service.storage import CheckpointStorage, PersistedCheckpoint

logger = logging.getLogger(__name__)

PART_PREFIX = ".ckval-part-"


class StoredPart(Protocol):
    """What assembling reads of one rank's stored part (the registry's PartRecord: this
    module sits below the registry and names none of its types)."""

    @property
    def rank(self) -> int: ...

    @property
    def location(self) -> str: ...

    @property
    def files(self) -> dict[str, Any] | None: ...


class ShardConflict(InvalidInput):
    """Ranks wrote different content under one relative file name (CKVAL_SHARD_CONFLICTS=error)."""


@dataclasses.dataclass(frozen=True)
class Conflict:
    """One relative file that ranks wrote with different content (or a file of one rank
    where another has a folder: ``reason``); ``kept`` is the rank whose file the
    checkpoint holds."""

    path: str
    kept: int
    dropped: tuple[int, ...]
    reason: str | None = None

    def __str__(self) -> str:
        dropped = ", ".join(str(rank) for rank in self.dropped)
        if self.reason is not None:
            return f"{self.path!r}: rank(s) {dropped}'s file left out, {self.reason}"
        return f"{self.path!r}: rank {self.kept}'s file kept, rank(s) {dropped} differ"


def part_path(checkpoint_path: str, rank: int) -> str:
    return posixpath.join(checkpoint_path, f"{PART_PREFIX}{rank:05d}")


def check_part_names(source: CheckpointFolder, rank: int) -> None:
    """Refuses a rank's folder that holds a name ckval keeps for the parts of a sharded
    checkpoint (``.ckval-part-*`` at its top): stored, it would land in another rank's
    part. Raises InvalidInput naming the rank and the files, before anything is stored."""
    reserved = [
        rel
        for rel in [*(rel for rel, _ in source.files), *source.folders]
        if rel.split("/", 1)[0].startswith(PART_PREFIX)
    ]
    if reserved:
        shown = ", ".join(repr(rel) for rel in sorted(reserved)[:5])
        raise InvalidInput(
            f"report() on rank {rank}: its checkpoint folder {source.path!r} holds {shown}: "
            f"names starting with {PART_PREFIX!r} are ckval's own in a checkpoint that "
            "several ranks write. Rename them; nothing of this report was stored."
        )


def store_part(
    storage: CheckpointStorage,
    checkpoint_path: str,
    rank: int,
    source: CheckpointFolder,
    staged: StagedCheckpoint | None = None,
) -> tuple[str, dict[str, Any]]:
    """Stores one rank's files as its part of the checkpoint at ``checkpoint_path``;
    returns where the part's files are and their sizes and digests.

    Local storage: a staged copy (made here if not given) renamed to the rank's part
    folder. Elsewhere: each file copied straight to its place in the checkpoint folder,
    hashed as it is copied.
    """
    check_part_names(source, rank)
    if not storage.is_local:
        files: dict[str, Any] = {}
        for rel, src in source.files:
            with storage.fs.open(posixpath.join(checkpoint_path, rel), "wb") as fout:
                files[rel] = copy_file(src, fout)
        return checkpoint_path, files
    target = part_path(checkpoint_path, rank)
    if staged is None:
        staged = storage_stage(storage, source, checkpoint_path)
    make_private_folders(checkpoint_path)
    if os.path.lexists(target):  # rename() would replace an empty folder there
        storage.discard(staged)
        raise InvalidInput(f"rank {rank}'s part is stored already at {target}; nothing replaced")
    os.rename(staged.path, target)
    os.unlink(os.path.join(target, MANIFEST_NAME))  # the part's files are in the registry
    return target, staged.files


def storage_stage(
    storage: CheckpointStorage, source: CheckpointFolder, checkpoint_path: str
) -> StagedCheckpoint:
    """A staged copy of one rank's folder in the run's folder (local storage)."""
    namespace, run = _namespace_and_run(storage, checkpoint_path)
    return storage.stage(source, namespace, run)


def _namespace_and_run(storage: CheckpointStorage, checkpoint_path: str) -> tuple[str, str]:
    """The namespace and run whose folder holds ``checkpoint_path`` (it lies at
    ``<root>/<namespace>/<run>/[attempt-N/]checkpoint_<index>``)."""
    relative = posixpath.relpath(checkpoint_path, storage.root).split("/")
    return relative[0], relative[1]


def assemble(
    storage: CheckpointStorage, checkpoint_path: str, parts: Sequence[StoredPart], on_conflict: str
) -> tuple[PersistedCheckpoint, list[Conflict]]:
    """The parts made one checkpoint folder at ``checkpoint_path``, with one manifest.

    Raises ShardConflict, changing nothing, when ranks differ on a file and
    ``on_conflict`` is ``"error"``.
    """
    owners, conflicts = _owners(parts)
    if conflicts and on_conflict == "error":
        raise ShardConflict(
            f"ranks wrote different files under the same name in {checkpoint_path}: "
            + "; ".join(str(c) for c in conflicts)
            + ". Write each rank's shard under a name of its own (torch.distributed."
            "checkpoint does), or set CKVAL_SHARD_CONFLICTS=warn to keep one rank's."
        )
    if storage.is_local:
        for rel, (rank, _) in sorted(owners.items()):
            _move(posixpath.join(part_path(checkpoint_path, rank), rel), checkpoint_path, rel)
        for part in parts:
            folder = part_path(checkpoint_path, part.rank)
            if os.path.lexists(folder):
                storage.fs.rm(folder, recursive=True)
    else:
        conflicts = _settle_in_place(storage, checkpoint_path, parts, owners, conflicts)
    for conflict in conflicts:
        logger.warning("checkpoint %s: %s", checkpoint_path, conflict)
    files = {rel: entry for rel, (_, entry) in sorted(owners.items())}
    manifest = storage.write_manifest(checkpoint_path, files)
    return storage.persisted(checkpoint_path, files, manifest), conflicts


def _owners(parts: Sequence[StoredPart]) -> tuple[dict[str, tuple[int, Any]], list[Conflict]]:
    """Which rank's file each relative path takes (the lowest rank's), and the paths
    that ranks differ on: different content, or a file where a lower rank has a folder
    (or the reverse)."""
    owners: dict[str, tuple[int, Any]] = {}
    folders: dict[str, int] = {}  # a folder of an owned file -> the rank that owns it
    differing: dict[str, list[int]] = {}
    clashes: list[Conflict] = []
    for part in sorted(parts, key=lambda p: p.rank):
        for rel, entry in sorted((part.files or {}).items()):
            above = _folders_above(rel)
            blocking = next((folder for folder in above if folder in owners), None)
            if rel in owners:
                if not same_content(owners[rel][1], entry):
                    differing.setdefault(rel, []).append(part.rank)
            elif blocking is not None:
                kept = owners[blocking][0]
                reason = f"{blocking!r} is rank {kept}'s file, not a folder"
                clashes.append(Conflict(rel, kept, (part.rank,), reason))
            elif rel in folders:
                reason = f"it is a folder of rank {folders[rel]}'s files"
                clashes.append(Conflict(rel, folders[rel], (part.rank,), reason))
            else:
                owners[rel] = (part.rank, entry)
                for folder in above:
                    folders.setdefault(folder, part.rank)
    conflicts = [Conflict(rel, owners[rel][0], tuple(r)) for rel, r in differing.items()]
    return owners, sorted(conflicts + clashes, key=lambda c: (c.path, c.dropped))


def _folders_above(rel: str) -> list[str]:
    """ "a/b/c" -> ["a", "a/b"]."""
    segments = rel.split("/")[:-1]
    return ["/".join(segments[: depth + 1]) for depth in range(len(segments))]


def _settle_in_place(
    storage: CheckpointStorage,
    checkpoint_path: str,
    parts: Sequence[StoredPart],
    owners: dict[str, tuple[int, Any]],
    conflicts: list[Conflict],
) -> list[Conflict]:
    """Object storage, where each rank wrote its files in place: a file that ranks wrote
    with different content holds the last one written, whichever rank's that is (found
    by its digest, and ``owners`` set to it); a file left out is deleted. Raises
    InvalidInput when a file is no rank's whole file (ranks wrote it at once on a
    storage that does not replace a file whole)."""
    settled = []
    for conflict in conflicts:
        target = posixpath.join(checkpoint_path, conflict.path)
        if conflict.reason is not None:
            if storage.fs.exists(target):  # two ranks may have left out the same file
                storage.fs.rm(target)
            settled.append(conflict)
            continue
        written = {
            part.rank: part.files[conflict.path]
            for part in parts
            if part.files and conflict.path in part.files
        }
        kept = _rank_of_stored(storage, target, written)
        owners[conflict.path] = (kept, written[kept])
        dropped = tuple(rank for rank in sorted(written) if rank != kept)
        settled.append(Conflict(conflict.path, kept, dropped))
    return settled


def _rank_of_stored(storage: CheckpointStorage, target: str, written: dict[int, Any]) -> int:
    """The rank whose file ``target`` holds, by its digest."""
    algorithm = algorithm_of({str(rank): entry for rank, entry in written.items()})
    with storage.fs.open(target, "rb") as f:
        stored = copy_hashing(f, None, algorithm)
    for rank, entry in sorted(written.items()):
        if same_content(entry, stored):
            return rank
    raise InvalidInput(
        f"{target} holds no rank's file: ranks {sorted(written)} wrote it at the same time, "
        "and the storage kept a mix. Write each rank's file under a name of its own; this "
        "report is not a checkpoint."
    )


def _move(source: str, checkpoint_path: str, rel: str) -> None:
    """Renames one part's file into the checkpoint folder (local storage), never over a
    file: ``_owners`` gave each path one rank, so one there is no rank's."""
    target = posixpath.join(checkpoint_path, rel)
    make_private_folders(os.path.dirname(target))
    if os.path.lexists(target):
        raise InvalidInput(f"{target} exists already; sealing replaces no file")
    os.rename(source, target)


def adopt_shared(
    storage: CheckpointStorage, parts: Sequence[StoredPart], namespace: str, run: str
) -> PersistedCheckpoint:
    """NO_UPLOAD from several ranks: the one folder every rank wrote into, registered
    where it is. Its manifest covers every rank's files: those each rank hashed as its
    own (``part.files``), and the others (metadata, configs) hashed here."""
    folders = sorted({part.location for part in parts})
    if len(folders) != 1:
        by_rank = ", ".join(f"rank {p.rank}: {p.location}" for p in parts)
        raise InvalidInput(
            "NO_UPLOAD from several ranks needs every rank to report the same folder, which "
            f"all of them wrote into; got {by_rank}. Report each rank's own folder with "
            "checkpoint_upload_mode SYNC or ASYNC instead (ckval copies each rank's files "
            "into one checkpoint)."
        )
    hashed = {rel: entry for part in parts for rel, entry in (part.files or {}).items()}
    return storage.adopt(folders[0], namespace, run, hashed=hashed)


def hash_own_files(
    storage: CheckpointStorage, uri: str, namespace: str, run: str, owns: Callable[[str], bool]
) -> dict[str, Any]:
    """NO_UPLOAD from several ranks: the sizes and digests of the files of the shared
    folder ``uri`` that ``owns(relative path)`` says are this rank's (its shards)."""
    return storage.hash_in_place(uri, namespace, run, owns)
