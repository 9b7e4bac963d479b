"""A checkpoint folder as ckval copies and checks it: the manifest (each file's size and
sha256, the empty folders), the scan of a local folder, and the staged copy of one.

Manifest entries are plain relative paths that stay inside the folder, checked when a
manifest is written and when it is read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from validation_service.errors import CheckpointNotFound, InvalidInput

MANIFEST_NAME = ".ckval-manifest.json"
_CHUNK = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]
    # Empty folders of a local checkpoint: an empty folder added later fails verification
    # as an added file does (listed only when there are some, so other manifests read
    # as they always did).
    folders: tuple[str, ...] = ()

    @property
    def total_size(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"version": 1, "files": self.files, "total_size": self.total_size}
        if self.folders:
            body["folders"] = sorted(self.folders)
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """The manifest in ``data``; raises ValueError naming what is wrong with it."""
        try:
            body = json.loads(data)
            files, folders = body["files"], body.get("folders", [])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"its manifest is not a ckval manifest ({exc})") from None
        if not isinstance(files, dict) or not isinstance(folders, list):
            raise ValueError("its manifest's 'files' is not a mapping or 'folders' no list")
        for rel in folders:
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise ValueError(f"its manifest lists the folder {rel!r}, {problem}")
        for rel, entry in files.items():
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise ValueError(f"its manifest lists {rel!r}, {problem}")
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)
            ):
                raise ValueError(f"its manifest's entry for {rel!r} has no size and sha256")
        return cls(files=files, folders=tuple(folders))


def manifest_entry_problem(rel: object) -> str | None:
    """Why ``rel`` cannot be a manifest entry, or None if it can.

    An entry is a relative posix path that stays inside the checkpoint folder: no
    leading '/', no '..', '.' or empty segments, no NUL. Checked on writing a manifest
    and on reading one, so that a manifest can never make a download write elsewhere.
    """
    if not isinstance(rel, str) or not rel:
        return "which is not a file name"
    if rel.startswith("/") or (len(rel) > 1 and rel[1] == ":"):
        return "an absolute path"
    if "\x00" in rel:
        return "which contains NUL"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "which has a '..', '.' or empty segment"
    return None


@dataclasses.dataclass(frozen=True)
class CheckpointFolder:
    """A local checkpoint folder as scanned: (relative path, file to read) for each file,
    and the relative paths of its empty folders."""

    path: str
    files: tuple[tuple[str, str], ...]
    folders: tuple[str, ...] = ()


class _UnsafeFolder(Exception):
    """A checkpoint folder that cannot be copied or trusted as it is (message: why)."""


def _local_tree(folder: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(relative posix path, real path) of every file under a local folder, and the
    relative paths of its empty folders, both sorted.

    Symlinks are followed, to files and to folders, as long as their target lies inside
    the folder: the copy holds their content as regular files. A symlink that leads out
    of the folder, dangles, or points back at a folder it is in (a cycle), and anything
    that is neither a file nor a folder, raises _UnsafeFolder: never silently left out.
    """
    root = os.path.realpath(folder)
    found: list[tuple[str, str]] = []
    empty: list[str] = []
    pending = [(root, "", frozenset({root}))]  # (real folder, its relative path/, ancestors)
    while pending:
        directory, prefix, ancestors = pending.pop()
        with os.scandir(directory) as entries:
            names = sorted(entry.name for entry in entries)
        names = [name for name in names if prefix + name != MANIFEST_NAME]
        if prefix and not names:
            empty.append(prefix.rstrip("/"))
        for name in names:
            rel = prefix + name
            full = os.path.join(directory, name)
            target = os.path.realpath(full)
            if os.path.islink(full):
                if target != root and not target.startswith(root + os.sep):
                    raise _UnsafeFolder(
                        f"{rel!r} is a symlink to {target}, outside the checkpoint folder"
                    )
                if not os.path.exists(target):
                    raise _UnsafeFolder(f"{rel!r} is a symlink to {target}, which does not exist")
            if os.path.isdir(target):
                if target in ancestors:
                    raise _UnsafeFolder(
                        f"{rel!r} is a symlink to a folder that contains it ({target}): a cycle"
                    )
                pending.append((target, rel + "/", ancestors | {target}))
            elif os.path.isfile(target):
                found.append((rel, target))
            else:
                raise _UnsafeFolder(f"{rel!r} is neither a regular file nor a folder")
    return sorted(found), sorted(empty)


def _parents(rels) -> set[str]:
    """Every folder above the relative paths ``rels`` ("a/b/c" -> "a", "a/b")."""
    return {rel.rsplit("/", depth)[0] for rel in rels for depth in range(1, rel.count("/") + 1)}


def copy_local_file(source: str, fout) -> dict[str, Any]:
    """Copies the local file ``source`` into the new local file ``fout`` (opened for
    binary writing, nothing written yet) in the kernel, while a second thread hashes the
    source: a copy as fast as ``cp``'s where the machine has a core to spare for sha256.

    Returns the size and sha256 of what was read; raises ValueError when the file
    changed size while it was copied (its copy and its hash would differ).
    """
    hashed = _hashing_threads().submit(_sha256_of, source)
    with open(source, "rb") as fin:
        copied = _kernel_copy(fin, fout)
    entry = hashed.result()
    if entry["size"] != copied:
        raise ValueError(
            f"{source!r} changed while it was copied ({copied} bytes copied, "
            f"{entry['size']} hashed): leave a reported folder as it is until its copy is done"
        )
    return entry


_hashing_pool: ThreadPoolExecutor | None = None
_hashing_lock = threading.Lock()


def _hashing_threads() -> ThreadPoolExecutor:
    global _hashing_pool
    with _hashing_lock:
        if _hashing_pool is None:
            _hashing_pool = ThreadPoolExecutor(4, thread_name_prefix="ckval-hash")
        return _hashing_pool


def _sha256_of(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _copy_hashing(f, None)


def _kernel_copy(fin, fout) -> int:
    """Copies ``fin`` into ``fout`` with copy_file_range (sendfile where the kernel or the
    filesystems refuse it; a plain loop as the last resort); returns the bytes copied."""
    fout.flush()
    source, target = fin.fileno(), fout.fileno()
    copied = 0
    for kernel_call in (_copy_file_range, _sendfile):
        try:
            while count := kernel_call(source, target, copied):
                copied += count
            return copied
        except OSError as exc:
            if copied or exc.errno not in _NO_KERNEL_COPY:
                raise
    while chunk := fin.read(_CHUNK):
        fout.write(chunk)
        copied += len(chunk)
    return copied


_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _copy_file_range(source: int, target: int, offset: int) -> int:
    return os.copy_file_range(source, target, _CHUNK * 64)


def _sendfile(source: int, target: int, offset: int) -> int:
    return os.sendfile(target, source, offset, _CHUNK * 64)


def _copy_hashing(fin, fout) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    while chunk := fin.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if fout is not None:
            fout.write(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def scan_folder(local_dir: str | os.PathLike) -> CheckpointFolder:
    """The files of a local checkpoint folder, as an upload copies them.

    Lists only (reads no file): call it before anything is reserved or written, so that
    a folder that cannot be stored is refused first. Symlinks that stay inside the
    folder are followed (their content is copied as regular files); a symlink that
    leads out of it, that dangles, or that loops back is refused.
    """
    source = Path(local_dir)
    if not source.is_dir():
        raise CheckpointNotFound(str(source), "the reported checkpoint is not a directory")
    try:
        files, folders = _local_tree(str(source))
    except _UnsafeFolder as exc:
        raise InvalidInput(
            f"Checkpoint folder {str(source)!r} cannot be stored: {exc}. Nothing was "
            "stored. Copy the linked files into the folder (or save them there), then "
            "report it again."
        ) from None
    return CheckpointFolder(str(source), tuple(files), tuple(folders))


@dataclasses.dataclass(frozen=True)
class StagedCheckpoint:
    """A copy of a checkpoint in its run's folder, not yet under its report index."""

    path: str
    files: dict[str, dict[str, Any]]
    manifest: bytes
