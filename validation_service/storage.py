"""Checkpoint storage over fsspec: upload with a manifest (sizes, sha256), verify, download."""

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

from validation_service.errors import CheckpointCorrupt, CheckpointNotFound, InvalidInput

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
        return cls(files=json.loads(data)["files"])


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
        self.root = root_path.rstrip("/") or "/"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.root_uri!r})"

    # ------------------------------------------------------------------ paths
    def checkpoint_path(self, namespace: str, run: str, report_index: int) -> str:
        return posixpath.join(self.root, namespace, run, f"checkpoint_{report_index:06d}")

    def uri_for(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def path_of(self, uri: str) -> str:
        """The storage-relative path of a URI, refusing anything outside the root."""
        _, path = _filesystem(uri, self.storage_options)
        if self.is_local:
            path = os.path.abspath(os.path.expanduser(path))
        normalized = posixpath.normpath(path)
        if ".." in path.split("/") or not (
            normalized == self.root or normalized.startswith(self.root.rstrip("/") + "/")
        ):
            raise InvalidInput(
                f"Checkpoint {uri!r} is outside the storage root {self.root_uri!r}. Copy it "
                "under the root, or use CheckpointUploadMode.SYNC to let ckval upload it."
            )
        return normalized

    # ----------------------------------------------------------------- upload
    def upload(
        self, local_dir: str | os.PathLike, namespace: str, run: str, report_index: int
    ) -> PersistedCheckpoint:
        """Copies a local checkpoint folder into storage, hashing as it copies."""
        source = Path(local_dir)
        if not source.is_dir():
            raise CheckpointNotFound(str(source), "the reported checkpoint is not a directory")
        dest = self.checkpoint_path(namespace, run, report_index)
        files: dict[str, dict[str, Any]] = {}
        if self.is_local:
            # Write beside the destination, then rename: a crash never leaves a half copy.
            parent = os.path.dirname(dest)
            os.makedirs(parent, exist_ok=True)
            staging = os.path.join(parent, f".staging-{uuid.uuid4().hex}")
            try:
                os.mkdir(staging)  # an empty checkpoint folder is still a checkpoint
                for rel, src in _walk(source):
                    target = os.path.join(staging, rel)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(src, "rb") as fin, open(target, "wb") as fout:
                        files[rel] = _copy_hashing(fin, fout)
                manifest = self._write_manifest(staging, files)
                if os.path.exists(dest):
                    shutil.rmtree(dest)
                os.replace(staging, dest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        else:
            if self.fs.exists(dest):
                self.fs.rm(dest, recursive=True)
            for rel, src in _walk(source):
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
        files = {}
        for rel, full in self._remote_files(path):
            with self.fs.open(full, "rb") as f:
                files[rel] = _copy_hashing(f, None)
        return self._persisted(path, files, self._write_manifest(path, files))

    def _write_manifest(self, directory: str, files: dict[str, dict[str, Any]]) -> bytes:
        manifest = Manifest(files).to_bytes()
        with self.fs.open(posixpath.join(directory, MANIFEST_NAME), "wb") as f:
            f.write(manifest)
        return manifest

    def _persisted(self, path: str, files: dict, manifest: bytes) -> PersistedCheckpoint:
        digest = hashlib.sha256(manifest).hexdigest()
        return PersistedCheckpoint(self.uri_for(path), Manifest(files).total_size, digest)

    # ----------------------------------------------------------------- verify
    def read_manifest(self, uri: str, manifest_sha256: str | None) -> Manifest:
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
        return Manifest.from_bytes(data)

    def verify(self, uri: str, manifest_sha256: str | None) -> Manifest:
        """Checks every file's size and sha256 against the manifest, in place."""
        manifest = self.read_manifest(uri, manifest_sha256)
        path = self.path_of(uri)
        for rel, expected in manifest.files.items():
            self._check_file(uri, rel, posixpath.join(path, rel), expected, None)
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
        for rel, expected in manifest.files.items():
            target = os.path.join(target_root, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as out:
                self._check_file(uri, rel, posixpath.join(path, rel), expected, out)
        return target_root

    def _check_file(self, uri: str, rel: str, full: str, expected: dict, out) -> None:
        try:
            with self.fs.open(full, "rb") as f:
                got = _copy_hashing(f, out)
        except FileNotFoundError:
            raise CheckpointNotFound(
                uri, f"file {rel!r} listed in the manifest is missing"
            ) from None
        if got["size"] != expected["size"]:
            raise CheckpointCorrupt(
                uri, f"{rel!r} has {got['size']} bytes, the manifest says {expected['size']}"
            )
        if got["sha256"] != expected["sha256"]:
            raise CheckpointCorrupt(uri, f"{rel!r} has a different sha256 than the manifest")

    def delete(self, uri: str) -> None:
        path = self.path_of(uri)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def _remote_files(self, path: str):
        for full in sorted(self.fs.find(path)):
            rel = posixpath.relpath(full, path)
            if rel != MANIFEST_NAME:
                yield rel, full


def _walk(source: Path):
    for full in sorted(source.rglob("*")):
        if full.is_file():
            rel = full.relative_to(source).as_posix()
            if rel != MANIFEST_NAME:
                yield rel, full


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
