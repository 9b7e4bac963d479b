"""A checkpoint folder as ckval copies and checks it: the manifest (each file's size and
digest, the algorithm that made them, the empty folders), the scan of a local folder,
and the one-pass copy of a file.

Manifest entries are plain relative paths that stay inside the folder, checked when a
manifest is written and when it is read. New manifests use BLAKE3; those of earlier
releases (SHA-256, no algorithm named) verify as they always did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from validation_service.errors import CheckpointNotFound, InvalidInput

MANIFEST_NAME = ".ckval-manifest.json"


def _blake3():
    import blake3  # on first use: importing trainer_integration stays cheap

    return blake3.blake3()


# The digests a manifest may name; each file's entry holds its digest under that name.
DIGESTS = {"blake3": _blake3, "sha256": hashlib.sha256}
DIGEST_ALGORITHM = "blake3"  # what ckval writes; "sha256" is what earlier releases wrote
_LEGACY_ALGORITHM = "sha256"  # a manifest that names no algorithm
# One private buffer per copy: each byte is read once into it, hashed there and written
# from there (small enough to stay in the core's cache between the three).
_BUFFER = 128 * 1024


class UnknownDigestAlgorithm(ValueError):
    """A manifest names a digest this release of ckval does not know."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]
    # Empty folders of a local checkpoint: an empty folder added later fails verification
    # as an added file does (listed only when there are some, so other manifests read
    # as they always did).
    folders: tuple[str, ...] = ()
    algorithm: str = DIGEST_ALGORITHM

    @property
    def total_size(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "version": 2,
            "algorithm": self.algorithm,
            "files": self.files,
            "total_size": self.total_size,
        }
        if self.folders:
            body["folders"] = sorted(self.folders)
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """The manifest in ``data``; raises ValueError naming what is wrong with it
        (UnknownDigestAlgorithm for a digest this release does not know)."""
        try:
            body = json.loads(data)
            files, folders = body["files"], body.get("folders", [])
            algorithm = body.get("algorithm", _LEGACY_ALGORITHM)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"its manifest is not a ckval manifest ({exc})") from None
        if algorithm not in DIGESTS:
            raise UnknownDigestAlgorithm(
                f"its manifest names the digest algorithm {algorithm!r}, which this release "
                f"of ckval does not know (it knows {', '.join(sorted(DIGESTS))}): it was "
                "written by a newer ckval. Upgrade ckval where checkpoints are verified "
                "(the validation workers); the checkpoint's files were not read"
            )
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
                and isinstance(entry.get(algorithm), str)
            ):
                raise ValueError(f"its manifest's entry for {rel!r} has no size and {algorithm}")
        return cls(files=files, folders=tuple(folders), algorithm=algorithm)


def algorithm_of(files: dict[str, dict[str, Any]]) -> str:
    """The one digest algorithm of file entries (ckval's own for none); raises
    InvalidInput when they were hashed with several (copies made by different releases
    of ckval: one manifest names one algorithm)."""
    found = {name for entry in files.values() for name in DIGESTS if name in entry}
    if len(found) > 1:
        raise InvalidInput(
            f"the files were hashed with different digests ({', '.join(sorted(found))}): "
            "the ranks of one report run different releases of ckval. Install one release "
            "on every worker; nothing was registered."
        )
    return found.pop() if found else DIGEST_ALGORITHM


def same_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two file entries (size and digest) describe the same bytes."""
    return a == b


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


def copy_hashing(fin, fout=None, algorithm: str = DIGEST_ALGORITHM) -> dict[str, Any]:
    """Reads ``fin`` once, each piece into one private buffer, hashes it there and writes
    it to ``fout`` from there (nothing written when None); returns the size and digest.

    The bytes written are the bytes hashed, whatever changes in the source meanwhile,
    and memory stays at one buffer whatever the file's size. ``fin`` is a local file
    opened unbuffered (``open(path, "rb", buffering=0)``: one read call per piece) or
    any fsspec file.
    """
    digest = DIGESTS[algorithm]()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    size = 0
    while count := fin.readinto(buffer):
        piece = view[:count]
        digest.update(piece)
        if fout is not None:
            fout.write(piece)
        size += count
    return {"size": size, algorithm: digest.hexdigest()}


def copy_file(source: str, fout) -> dict[str, Any]:
    """Copies the local file ``source`` into ``fout`` in one pass (copy_hashing)."""
    with open(source, "rb", buffering=0) as fin:
        return copy_hashing(fin, fout)


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
