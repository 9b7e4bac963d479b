"""Checkpoint storage over fsspec: upload with a manifest (sizes, sha256), verify, download.

Every path it writes, reads or deletes is checked to lie inside the storage root first,
after resolving (symlinks for a local root, ``..`` for any root); manifest entries are
plain relative paths, checked when written and when read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from validation_service.errors import (
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
    InvalidInput,
)
from validation_service.names import check_name

MANIFEST_NAME = ".ckval-manifest.json"
_CHUNK = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PersistedCheckpoint:
    uri: str
    size_bytes: int
    manifest_sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]

    @property
    def total_size(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    def to_bytes(self) -> bytes:
        body = {"version": 1, "files": self.files, "total_size": self.total_size}
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """The manifest in ``data``; raises ValueError naming what is wrong with it."""
        try:
            files = json.loads(data)["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"its manifest is not a ckval manifest ({exc})") from None
        if not isinstance(files, dict):
            raise ValueError("its manifest's 'files' is not a mapping")
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
        return cls(files=files)


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


def _filesystem(uri: str, storage_options: dict[str, Any] | None = None):
    try:
        return fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except (ValueError, ImportError) as exc:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        raise InvalidInput(
            f"Unsupported storage URI {uri!r} (scheme {scheme!r}): {exc}. Use a local "
            "path, s3://bucket/prefix, or another URI of an installed fsspec filesystem."
        ) from None


class CheckpointStorage:
    """Where checkpoints live: a local folder, S3, or any fsspec URI."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None):
        self.root_uri = root
        self.storage_options = storage_options or {}
        self.fs, root_path = _filesystem(root, self.storage_options)
        if self.is_local:
            root_path = os.path.abspath(os.path.expanduser(root_path))
        self.root = posixpath.normpath(root_path).rstrip("/") or "/"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.root_uri!r})"

    # ------------------------------------------------------------------ paths
    def checkpoint_path(
        self, namespace: str, run: str, report_index: int, *, attempt: int = 1
    ) -> str:
        """Where the report ``report_index`` of a run is stored, checked to be in the root:
        ``<root>/<namespace>/<run>/checkpoint_<index>``, with ``attempt-<N>/`` before the
        last part for a later attempt of the run (whose report indices start at 0 again).

        Raises InvalidInput for a namespace or run name that is no plain folder name
        (names.check_name), before anything is written.
        """
        check_name("namespace", namespace)
        check_name("run name", run)
        if not isinstance(report_index, int) or isinstance(report_index, bool) or report_index < 0:
            raise InvalidInput(f"report index must be an int >= 0, got {report_index!r}")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
            raise InvalidInput(f"run attempt must be an int >= 1, got {attempt!r}")
        folder = posixpath.join(self.root, namespace, run)
        if attempt > 1:
            folder = posixpath.join(folder, f"attempt-{attempt}")
        path = posixpath.join(folder, f"checkpoint_{report_index:06d}")
        return self._inside_root(path, path)

    def uri_for(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def path_of(self, uri: str) -> str:
        """The storage path of a URI, refusing anything that is not inside the root."""
        fs, path = _filesystem(uri, self.storage_options)
        if type(fs) is not type(self.fs):
            raise InvalidInput(
                f"Checkpoint {uri!r} is not on the storage {self.root_uri!r} (another "
                "filesystem). Copy it under the root, or use CheckpointUploadMode.SYNC to "
                "let ckval upload it."
            )
        return self._inside_root(path, uri)

    def _inside_root(self, path: str, shown: str) -> str:
        """``path`` normalised, if it lies strictly inside the root; raises InvalidInput if not.

        A local path is compared after resolving symlinks (os.path.realpath), so that a
        symlinked folder under the root cannot lead out of it; a remote path has no
        symlinks, and any '..' in it is refused outright.
        """
        root: str | None
        if self.is_local:
            normalized = os.path.abspath(os.path.expanduser(path))
            resolved, root = os.path.realpath(normalized), os.path.realpath(self.root)
        else:
            normalized = resolved = posixpath.normpath(path)
            root = None if ".." in path.split("/") else self.root
        if root is None or not resolved.startswith(root.rstrip("/") + "/"):
            resolves_to = f" (it resolves to {resolved!r})" if resolved != shown else ""
            raise InvalidInput(
                f"Checkpoint {shown!r} is outside the storage root {self.root_uri!r}"
                f"{resolves_to}. Nothing was read, written or deleted. Copy it under the "
                "root, or use CheckpointUploadMode.SYNC to let ckval upload it."
            )
        return normalized

    # ----------------------------------------------------------------- upload
    def scan(self, local_dir: str | os.PathLike) -> CheckpointFolder:
        """The files of a local checkpoint folder, as upload() will copy them.

        Lists only (reads no file): call it before anything is reserved or written, so
        that a folder that cannot be stored is refused first. Symlinks that stay inside
        the folder are followed (their content is copied as regular files); a symlink
        that leads out of it, that dangles, or that loops back is refused.
        """
        source = Path(local_dir)
        if not source.is_dir():
            raise CheckpointNotFound(str(source), "the reported checkpoint is not a directory")
        try:
            files = _local_files(str(source))
        except _UnsafeFolder as exc:
            raise InvalidInput(
                f"Checkpoint folder {str(source)!r} cannot be stored: {exc}. Nothing was "
                "stored. Copy the linked files into the folder (or save them there), then "
                "report it again."
            ) from None
        return CheckpointFolder(str(source), tuple(files))

    def upload(
        self,
        local_dir: str | os.PathLike | CheckpointFolder,
        namespace: str,
        run: str,
        report_index: int,
        *,
        attempt: int = 1,
    ) -> PersistedCheckpoint:
        """Copies a local checkpoint folder (or its scan()) into storage, hashing as it copies.

        Never overwrites: a folder already at the destination raises CheckpointExists.
        """
        dest = self.checkpoint_path(namespace, run, report_index, attempt=attempt)
        folder = local_dir if isinstance(local_dir, CheckpointFolder) else self.scan(local_dir)
        files: dict[str, dict[str, Any]] = {}
        if self.is_local:
            if os.path.lexists(dest):
                raise CheckpointExists(dest)
            # Write beside the destination, then rename: a crash never leaves a half copy.
            parent = os.path.dirname(dest)
            os.makedirs(parent, exist_ok=True)
            staging = os.path.join(parent, f".staging-{uuid.uuid4().hex}")
            try:
                os.mkdir(staging)  # an empty checkpoint folder is still a checkpoint
                for rel, src in folder.files:
                    target = os.path.join(staging, rel)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(src, "rb") as fin, open(target, "xb") as fout:
                        files[rel] = _copy_hashing(fin, fout)
                manifest = self._write_manifest(staging, files)
                if os.path.lexists(dest):
                    raise CheckpointExists(dest)
                os.rename(staging, dest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        else:
            if self.fs.exists(dest):
                raise CheckpointExists(self.uri_for(dest))
            for rel, src in folder.files:
                with open(src, "rb") as fin, self.fs.open(posixpath.join(dest, rel), "wb") as fout:
                    files[rel] = _copy_hashing(fin, fout)
            # The manifest goes last: its presence marks a complete upload.
            manifest = self._write_manifest(dest, files)
        return self._persisted(dest, files, manifest)

    def adopt(self, uri: str) -> PersistedCheckpoint:
        """Registers a checkpoint already in storage (NO_UPLOAD): writes its manifest in place."""
        path = self.path_of(uri)
        if not self.fs.isdir(path):
            raise CheckpointNotFound(uri, "no directory there")
        try:
            present = self._stored_files(path)
        except _UnsafeFolder as exc:
            raise InvalidInput(
                f"Checkpoint {uri!r} cannot be registered in place: {exc}. Nothing was "
                "written. Replace the link with the files it points to."
            ) from None
        files = {}
        for rel, full in present.items():
            with self._open_stored(full) as f:
                files[rel] = _copy_hashing(f, None)
        return self._persisted(path, files, self._write_manifest(path, files))

    def _write_manifest(self, directory: str, files: dict[str, dict[str, Any]]) -> bytes:
        for rel in files:
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise InvalidInput(
                    f"Checkpoint file {rel!r} cannot be listed in a manifest: {problem}. "
                    "Rename it; nothing was registered."
                )
        manifest = Manifest(files).to_bytes()
        with self.fs.open(posixpath.join(directory, MANIFEST_NAME), "wb") as f:
            f.write(manifest)
        return manifest

    def _persisted(self, path: str, files: dict, manifest: bytes) -> PersistedCheckpoint:
        digest = hashlib.sha256(manifest).hexdigest()
        return PersistedCheckpoint(self.uri_for(path), Manifest(files).total_size, digest)

    # ----------------------------------------------------------------- verify
    def read_manifest(self, uri: str, manifest_sha256: str | None) -> Manifest:
        """The checkpoint's manifest, checked against its sha256 and for unsafe entries."""
        path = self.path_of(uri)
        manifest_path = posixpath.join(path, MANIFEST_NAME)
        try:
            with self.fs.open(manifest_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if not self.fs.exists(path):
                raise CheckpointNotFound(uri) from None
            raise CheckpointNotFound(uri, f"its manifest {MANIFEST_NAME} is missing") from None
        if manifest_sha256 and hashlib.sha256(data).hexdigest() != manifest_sha256:
            raise CheckpointCorrupt(uri, "the manifest itself was changed")
        try:
            return Manifest.from_bytes(data)
        except ValueError as exc:
            raise CheckpointCorrupt(uri, f"{exc}; nothing was read or written") from None

    def verify(self, uri: str, manifest_sha256: str | None) -> Manifest:
        """Checks the folder holds exactly the manifest's files, each of its size and sha256.

        Raises CheckpointNotFound when files are missing and nothing else is wrong, and
        CheckpointCorrupt when files were added or changed; both name every such file.
        """
        manifest = self.read_manifest(uri, manifest_sha256)
        self._compare(uri, self.path_of(uri), manifest, None)
        return manifest

    def materialize(self, uri: str, manifest_sha256: str | None, workdir: str) -> str:
        """A verified local directory with the checkpoint's files.

        Local storage is verified in place and returned as is; remote storage is
        downloaded into ``workdir`` and verified while it downloads.
        """
        if self.is_local:
            self.verify(uri, manifest_sha256)
            return self.path_of(uri)
        manifest = self.read_manifest(uri, manifest_sha256)
        path = self.path_of(uri)
        target_root = tempfile.mkdtemp(prefix="ckpt-", dir=workdir)
        try:
            self._compare(uri, path, manifest, target_root)
        except BaseException:
            shutil.rmtree(target_root, ignore_errors=True)
            raise
        return target_root

    def _compare(self, uri: str, path: str, manifest: Manifest, target_root: str | None) -> None:
        """Compares the stored folder with its manifest, copying each file into
        ``target_root`` (a download) if given; raises naming every difference."""
        try:
            present = self._stored_files(path)
        except _UnsafeFolder as exc:
            raise CheckpointCorrupt(uri, str(exc)) from None
        missing = sorted(set(manifest.files) - set(present))
        extra = sorted(set(present) - set(manifest.files))
        changed: list[str] = []
        if not (missing or extra):  # otherwise it fails anyway: read nothing
            for rel, expected in sorted(manifest.files.items()):
                out = None if target_root is None else _open_download(target_root, rel)
                try:
                    with self._open_stored(present[rel]) as f:
                        got = _copy_hashing(f, out)
                except FileNotFoundError:
                    missing.append(rel)
                    continue
                finally:
                    if out is not None:
                        out.close()
                if got["size"] != expected["size"]:
                    changed.append(
                        f"{rel!r} has {got['size']} bytes, the manifest says {expected['size']}"
                    )
                elif got["sha256"] != expected["sha256"]:
                    changed.append(f"{rel!r} has a different sha256 than the manifest")
        if not (missing or extra or changed):
            return
        problems = []
        if missing:
            problems.append(f"file(s) listed in the manifest are missing: {_listed(missing)}")
        if extra:
            problems.append(f"file(s) not in the manifest were added: {_listed(extra)}")
        if changed:
            problems.append("; ".join(changed))
        if missing and not (extra or changed):
            raise CheckpointNotFound(uri, problems[0])
        raise CheckpointCorrupt(uri, "; ".join(problems))

    def delete(self, uri: str) -> None:
        path = self.path_of(uri)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def _stored_files(self, path: str) -> dict[str, str]:
        """Relative path -> full path of every file of a stored folder but its manifest.

        Raises _UnsafeFolder for a local symlink that leads out of the folder, and for a
        remote key that is no plain relative path.
        """
        if self.is_local:
            return dict(_local_files(path))
        self.fs.invalidate_cache(path)  # an extra file added since the last listing counts
        files = {}
        prefix = path.rstrip("/") + "/"
        for full in sorted(self.fs.find(path)):
            rel = full[len(prefix) :] if full.startswith(prefix) else full
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise _UnsafeFolder(f"it holds the key {full!r}, {problem}")
            if rel != MANIFEST_NAME:
                files[rel] = full
        return files

    def _open_stored(self, full: str):
        # Local files are opened as found (symlinks inside the folder already resolved).
        return open(full, "rb") if self.is_local else self.fs.open(full, "rb")


@dataclasses.dataclass(frozen=True)
class CheckpointFolder:
    """A local checkpoint folder as scanned: (relative path, file to read) for each file."""

    path: str
    files: tuple[tuple[str, str], ...]


class _UnsafeFolder(Exception):
    """A checkpoint folder that cannot be copied or trusted as it is (message: why)."""


def _local_files(folder: str) -> list[tuple[str, str]]:
    """(relative posix path, real path) of every file under a local folder, sorted.

    Symlinks are followed, to files and to folders, as long as their target lies inside
    the folder: the copy holds their content as regular files. A symlink that leads out
    of the folder, dangles, or points back at a folder it is in (a cycle), and anything
    that is neither a file nor a folder, raises _UnsafeFolder: never silently left out.
    """
    root = os.path.realpath(folder)
    found: list[tuple[str, str]] = []
    pending = [(root, "", frozenset({root}))]  # (real folder, its relative path/, ancestors)
    while pending:
        directory, prefix, ancestors = pending.pop()
        with os.scandir(directory) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            rel = prefix + name
            if rel == MANIFEST_NAME:
                continue
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
    return sorted(found)


def _open_download(target_root: str, rel: str):
    """Creates the file ``rel`` under ``target_root`` for writing; never one elsewhere."""
    target = os.path.join(target_root, rel)
    # Entries were checked when the manifest was read; resolving again costs nothing.
    if not os.path.realpath(target).startswith(os.path.realpath(target_root) + os.sep):
        raise InvalidInput(f"manifest entry {rel!r} would be written outside {target_root}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    return open(target, "xb")


def _listed(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _copy_hashing(fin, fout) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    while chunk := fin.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if fout is not None:
            fout.write(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def ray_checkpoint(uri: str, storage_options: dict[str, Any] | None = None):
    """A ray.train.Checkpoint for a stored checkpoint, read through fsspec."""
    from ray.train import Checkpoint

    fs, path = _filesystem(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        return Checkpoint(path)
    import pyarrow.fs

    return Checkpoint(path, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))
