"""One checkpoint from several ranks' folders: each rank's part stored in the report's
folder by that rank alone, and the parts assembled into one checkpoint folder.

A rank copies only its own files, into ``<checkpoint folder>/.ckval-part-<rank>/``
(local storage: a staged copy renamed there). Assembling moves each part's files up
into the checkpoint folder (a rename on local storage, a server-side move elsewhere: no
rank reads or sends another rank's bytes), drops the part folders and writes one
manifest over every rank's files. Two ranks with the same relative file: identical
content is kept once; different content keeps the lowest rank's file, with a warning,
or fails the assembly when ``CKVAL_SHARD_CONFLICTS=error``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from collections.abc import Sequence
from typing import Any, Protocol

from validation_service._home import make_private_folders
from validation_service.errors import InvalidInput
from validation_service.manifest import (
    MANIFEST_NAME,
    CheckpointFolder,
    StagedCheckpoint,
    _copy_hashing,
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
    """One relative file that ranks wrote with different content; ``kept`` is the rank
    whose file the checkpoint holds."""

    path: str
    kept: int
    dropped: tuple[int, ...]

    def __str__(self) -> str:
        dropped = ", ".join(str(rank) for rank in self.dropped)
        return f"{self.path!r}: rank {self.kept}'s file kept, rank(s) {dropped} differ"


def part_path(checkpoint_path: str, rank: int) -> str:
    return posixpath.join(checkpoint_path, f"{PART_PREFIX}{rank:05d}")


def store_part(
    storage: CheckpointStorage,
    checkpoint_path: str,
    rank: int,
    source: CheckpointFolder,
    staged: StagedCheckpoint | None = None,
) -> tuple[str, dict[str, Any]]:
    """Stores one rank's files as its part of the checkpoint at ``checkpoint_path``;
    returns the part's folder and its files' sizes and sha256.

    A staged copy (local storage) is renamed into place; otherwise the files are copied
    there, hashed as they are copied.
    """
    target = part_path(checkpoint_path, rank)
    if storage.is_local:
        if staged is None:
            staged = storage_stage(storage, source, checkpoint_path)
        make_private_folders(checkpoint_path)
        os.rename(staged.path, target)
        os.unlink(os.path.join(target, MANIFEST_NAME))  # the part's files are in the registry
        return target, staged.files
    files: dict[str, Any] = {}
    for rel, src in source.files:
        with open(src, "rb") as fin, storage.fs.open(posixpath.join(target, rel), "wb") as fout:
            files[rel] = _copy_hashing(fin, fout)
    return target, files


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

    Raises ShardConflict, moving nothing, when ranks differ on a file and
    ``on_conflict`` is ``"error"``.
    """
    owners, conflicts = _owners(parts)
    if conflicts and on_conflict == "error":
        raise ShardConflict(
            f"ranks wrote different files under the same name in {checkpoint_path}: "
            + "; ".join(str(c) for c in conflicts)
            + ". Write each rank's shard under a name of its own (torch.distributed."
            "checkpoint does), or set CKVAL_SHARD_CONFLICTS=warn to keep the lowest rank's."
        )
    for conflict in conflicts:
        logger.warning("checkpoint %s: %s", checkpoint_path, conflict)
    files: dict[str, Any] = {}
    for rel, (rank, entry) in sorted(owners.items()):
        _move(storage, posixpath.join(part_path(checkpoint_path, rank), rel), checkpoint_path, rel)
        files[rel] = entry
    for part in parts:
        folder = part_path(checkpoint_path, part.rank)
        if storage.fs.exists(folder):
            storage.fs.rm(folder, recursive=True)
    manifest = storage.write_manifest(checkpoint_path, files)
    return storage.persisted(checkpoint_path, files, manifest), conflicts


def _owners(parts: Sequence[StoredPart]) -> tuple[dict[str, tuple[int, Any]], list[Conflict]]:
    """Which rank's file each relative path takes (the lowest rank's), and the paths
    whose content differs between ranks."""
    owners: dict[str, tuple[int, Any]] = {}
    differing: dict[str, list[int]] = {}
    for part in sorted(parts, key=lambda p: p.rank):
        for rel, entry in (part.files or {}).items():
            if rel not in owners:
                owners[rel] = (part.rank, entry)
            elif owners[rel][1]["sha256"] != entry["sha256"]:
                differing.setdefault(rel, []).append(part.rank)
    conflicts = [Conflict(rel, owners[rel][0], tuple(r)) for rel, r in sorted(differing.items())]
    return owners, conflicts


def _move(storage: CheckpointStorage, source: str, checkpoint_path: str, rel: str) -> None:
    target = posixpath.join(checkpoint_path, rel)
    if storage.is_local:
        make_private_folders(os.path.dirname(target))
        os.rename(source, target)
    else:
        storage.fs.mv(source, target)


def adopt_shared(
    storage: CheckpointStorage, parts: Sequence[StoredPart], namespace: str, run: str
) -> PersistedCheckpoint:
    """NO_UPLOAD from several ranks: the one folder every rank wrote into, registered
    where it is (its manifest covers every rank's files)."""
    folders = sorted({part.location for part in parts})
    if len(folders) != 1:
        by_rank = ", ".join(f"rank {p.rank}: {p.location}" for p in parts)
        raise InvalidInput(
            "NO_UPLOAD from several ranks needs every rank to report the same folder, which "
            f"all of them wrote into; got {by_rank}. Report each rank's own folder with "
            "checkpoint_upload_mode SYNC or ASYNC instead (ckval copies each rank's files "
            "into one checkpoint)."
        )
    return storage.adopt(folders[0], namespace, run)
