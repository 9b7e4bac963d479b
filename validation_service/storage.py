"""Checkpoint storage over fsspec: upload with a manifest (sizes, digests), verify, download.

Every path it writes or deletes is checked to lie inside the storage root first, after
resolving (symlinks for a local root, ``..`` for any root); it deletes only inside a run's
own folder. A checkpoint registered in place (NO_UPLOAD) lies in its run's folder or
outside the root altogether. Manifest entries are plain relative paths, checked when
written and when read. Local folders and files are created owner-only (0700, 0600).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from validation_service._home import create_private_file, make_private_folders
from validation_service.errors import (
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
    InvalidInput,
)
from validation_service.manifest import (
    MANIFEST_NAME,
    CheckpointFolder,
    Manifest,
    StagedCheckpoint,
    UnknownDigestAlgorithm,
    _local_tree,
    _parents,
    _UnsafeFolder,
    algorithm_of,
    copy_file,
    copy_hashing,
    manifest_entry_problem,
    scan_folder,
)
from validation_service.names import check_name
from validation_service.secrets import mask_url

# The id file at a local storage's root (CheckpointStorage.identity).
STORAGE_ID_FILE = ".ckval-storage-id"

# A copy being made in a run's folder (storage.stage): never a checkpoint of its own.
STAGING_PREFIX = ".staging-"


@dataclasses.dataclass(frozen=True)
class PersistedCheckpoint:
    """A checkpoint as stored: where, how many bytes, and the SHA-256 of its manifest
    (each file's path, size and digest), which the registry keeps to detect damage (the
    files' own digests are in the manifest, BLAKE3 since manifests name their algorithm)."""

    uri: str
    size_bytes: int
    manifest_sha256: str


def _filesystem(uri: str, storage_options: dict[str, Any] | None = None):
    try:
        return fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except (ValueError, ImportError) as exc:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        raise InvalidInput(
            f"Unsupported storage URI {mask_url(uri)!r} (scheme {scheme!r}): {exc}. Use a local "
            "path, s3://bucket/prefix, or another URI of an installed fsspec filesystem."
        ) from None


def outside_folder(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[str, int]:
    """(URI, size in bytes) of an existing folder made outside training (a released model,
    a Hugging Face folder), local or any fsspec URI, for Registry.register; a local path
    becomes absolute. Raises CheckpointNotFound naming what is there instead."""
    fs, path = _filesystem(uri, storage_options)
    local = isinstance(fs, LocalFileSystem)
    if local:
        path = os.path.abspath(os.path.expanduser(path))
    try:
        is_dir = fs.isdir(path)
    except OSError as exc:
        raise CheckpointNotFound(uri, f"it cannot be read ({exc})") from None
    if not is_dir:
        what = "a file, not a folder" if fs.exists(path) else "nothing there"
        raise CheckpointNotFound(uri, f"{what}; register the folder holding the checkpoint")
    size = sum(int(info.get("size") or 0) for info in fs.find(path, detail=True).values())
    return (path if local else fs.unstrip_protocol(path)), size


def _has_manifest(uri: str, storage_options: dict[str, Any]) -> bool:
    fs, path = _filesystem(uri, storage_options)
    return fs.exists(posixpath.join(path, MANIFEST_NAME))


def _outside_folder_copy(uri: str, storage_options: dict[str, Any], workdir: str) -> str:
    """A registered outside folder to read: local, as it is; remote, downloaded."""
    fs, path = _filesystem(uri, storage_options)
    if not fs.isdir(path):
        raise CheckpointNotFound(
            uri,
            "the folder was deleted after it was registered (a trainer's own rotation, "
            "such as keep_latest_k, deletes its older step folders: watch with copy=True "
            "to keep a copy until it is validated)",
        )
    if isinstance(fs, LocalFileSystem):
        return os.path.abspath(os.path.expanduser(path))
    target_root = tempfile.mkdtemp(prefix="ckpt-", dir=workdir)
    fs.get(path.rstrip("/") + "/", target_root + "/", recursive=True)
    return target_root


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
        return f"CheckpointStorage({mask_url(self.root_uri)!r})"

    def identity(self) -> str:
        """What tells this storage from another: a remote URI names one place wherever it
        is read from; a local folder gets an id file (``.ckval-storage-id``) at its root,
        made once, so that one shared folder seen from two machines reads the same id and
        two machines' own folders of the same path do not."""
        if not self.is_local:
            return mask_url(f"{self.fs.unstrip_protocol(self.root)}")
        path = os.path.join(self.root, STORAGE_ID_FILE)
        make_private_folders(self.root)
        try:
            with open(path, "x") as f:  # exclusive: one id, whoever comes first
                f.write(uuid.uuid4().hex)
        except FileExistsError:
            pass
        with open(path) as f:
            return f.read().strip()

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
        folder = self.run_folder(namespace, run)
        if not isinstance(report_index, int) or isinstance(report_index, bool) or report_index < 0:
            raise InvalidInput(f"report index must be an int >= 0, got {report_index!r}")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
            raise InvalidInput(f"run attempt must be an int >= 1, got {attempt!r}")
        if attempt > 1:
            folder = posixpath.join(folder, f"attempt-{attempt}")
        path = posixpath.join(folder, f"checkpoint_{report_index:06d}")
        return self._inside_root(path, path)

    def run_folder(self, namespace: str, run: str) -> str:
        """``<root>/<namespace>/<run>``: the folder of every checkpoint of the run."""
        return posixpath.join(
            self.root, check_name("namespace", namespace), check_name("run name", run)
        )

    def in_run_folder(self, uri: str, namespace: str, run: str) -> bool:
        """Whether ``uri`` lies strictly inside the run's folder, as given and (local)
        after resolving symlinks."""
        try:
            path = self.path_of(uri)
        except InvalidInput:
            return False
        folder = self.run_folder(namespace, run)
        real = [(os.path.realpath(path), os.path.realpath(folder))] if self.is_local else []
        return all(inner.startswith(outer + "/") for inner, outer in [(path, folder), *real])

    def in_root(self, uri: str) -> bool:
        """Whether ``uri`` names the root or a path under it, as given or (local) resolved."""
        fs, path = _filesystem(uri, self.storage_options)
        if type(fs) is not type(self.fs):
            return False
        if not self.is_local:
            return _under(posixpath.normpath(path), self.root)
        given = os.path.abspath(os.path.expanduser(path))
        real_root = os.path.realpath(self.root)
        return _under(given, self.root) or _under(os.path.realpath(given), real_root)

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

    def readable_path(self, uri: str) -> str:
        """The path of a checkpoint to read: inside the root (checked as path_of does),
        or outside it altogether, where a NO_UPLOAD checkpoint is registered in place."""
        fs, path = _filesystem(uri, self.storage_options)
        remote_dots = not self.is_local and ".." in path.split("/")
        if self.in_root(uri) or type(fs) is not type(self.fs) or remote_dots:
            return self.path_of(uri)  # raises for a path that leads out of the root
        return os.path.abspath(os.path.expanduser(path)) if self.is_local else path

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
        """The files of a local checkpoint folder, as upload() will copy them (scan_folder)."""
        return scan_folder(local_dir)

    def upload(
        self,
        local_dir: str | os.PathLike | CheckpointFolder,
        namespace: str,
        run: str,
        report_index: int,
        *,
        attempt: int = 1,
    ) -> PersistedCheckpoint:
        """Copies a local checkpoint folder (or its scan()) into storage, hashing as it
        copies (one read of each byte).

        Never overwrites: a folder already at the destination raises CheckpointExists.
        """
        dest = self.checkpoint_path(namespace, run, report_index, attempt=attempt)
        folder = local_dir if isinstance(local_dir, CheckpointFolder) else scan_folder(local_dir)
        if self.is_local:
            if os.path.lexists(dest):
                raise CheckpointExists(dest)
            staged = self.stage(folder, namespace, run)
            try:
                return self.commit(staged, namespace, run, report_index, attempt)
            except BaseException:
                self.discard(staged)
                raise
        if self.fs.exists(dest):
            raise CheckpointExists(self.uri_for(dest))
        files: dict[str, dict[str, Any]] = {}
        for rel, src in folder.files:
            with self.fs.open(posixpath.join(dest, rel), "wb") as fout:
                files[rel] = copy_file(src, fout)
        # The manifest goes last: its presence marks a complete upload.
        manifest = self._write_manifest(dest, files)
        return self.persisted(dest, files, manifest)

    def stage(self, folder: CheckpointFolder, namespace: str, run: str) -> StagedCheckpoint:
        """Copies a scanned local folder into the run's folder under a staging name,
        hashing as it copies, before its report index is known (local storage only).

        commit() renames it to its index's folder: a crash never leaves a half copy there.
        """
        if not self.is_local:
            raise InvalidInput(f"staging needs local storage, not {self.root_uri!r}")
        run_dir = self._inside_root(self.run_folder(namespace, run), run)
        make_private_folders(run_dir)
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{uuid.uuid4().hex}")
        files: dict[str, dict[str, Any]] = {}
        try:
            os.mkdir(staging, 0o700)  # an empty checkpoint folder is still a checkpoint
            for rel in folder.folders:
                make_private_folders(os.path.join(staging, rel))
            for rel, src in folder.files:
                target = os.path.join(staging, rel)
                make_private_folders(os.path.dirname(target))
                with create_private_file(target) as fout:
                    files[rel] = copy_file(src, fout)
            manifest = self._write_manifest(staging, files, folder.folders)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return StagedCheckpoint(staging, files, manifest)

    def commit(
        self, staged: StagedCheckpoint, namespace: str, run: str, report_index: int, attempt: int
    ) -> PersistedCheckpoint:
        """Moves a staged copy to its report index's folder; never over an existing one
        (CheckpointExists, the staged copy left where it is)."""
        dest = self.checkpoint_path(namespace, run, report_index, attempt=attempt)
        if os.path.lexists(dest):
            raise CheckpointExists(dest)
        make_private_folders(os.path.dirname(dest))
        os.rename(staged.path, dest)
        return self.persisted(dest, staged.files, staged.manifest)

    def discard(self, staged: StagedCheckpoint) -> None:
        """Removes a staged copy that will not be committed."""
        shutil.rmtree(staged.path, ignore_errors=True)

    def adopt(
        self, uri: str, namespace: str, run: str, *, hashed: dict[str, Any] | None = None
    ) -> PersistedCheckpoint:
        """Registers a checkpoint where it is (NO_UPLOAD): writes its manifest in place.

        Under the storage root it must lie inside the reporter's own run folder
        (``<root>/<namespace>/<run>/...``): any other folder there is another run's (or
        another namespace's) to keep and delete. Outside the root it is registered where
        it is, and retention never deletes its files. ``hashed``: entries of its files
        hashed already (by the ranks that wrote them); the others are hashed here.
        """
        path, present, folders = self._in_place(uri, namespace, run)
        hashed = hashed or {}
        gone = sorted(set(hashed) - set(present))
        if gone:
            raise CheckpointNotFound(
                uri, f"file(s) hashed when they were reported are gone: {_listed(gone)}"
            )
        files = {}
        for rel, full in present.items():
            if rel in hashed:
                files[rel] = hashed[rel]
                continue
            with self._open_stored(full) as f:
                files[rel] = copy_hashing(f)
        return self.persisted(path, files, self._write_manifest(path, files, folders, True))

    def hash_in_place(
        self, uri: str, namespace: str, run: str, owns: Callable[[str], bool]
    ) -> dict[str, Any]:
        """Sizes and digests of the files of a NO_UPLOAD folder (checked as adopt() checks
        it) whose relative paths ``owns`` picks; writes nothing."""
        _, present, _ = self._in_place(uri, namespace, run)
        files = {}
        for rel, full in present.items():
            if owns(rel):
                with self._open_stored(full) as f:
                    files[rel] = copy_hashing(f)
        return files

    def _in_place(self, uri: str, namespace: str, run: str):
        """(path, files, empty folders) of a folder to register where it is, refused
        (InvalidInput, CheckpointNotFound) where NO_UPLOAD may not register it."""
        path = self.readable_path(uri)
        if self.in_root(uri) and not self.in_run_folder(uri, namespace, run):
            raise InvalidInput(
                f"Checkpoint {uri!r} lies in ckval's storage root {self.root_uri!r} but not "
                f"inside the folder of run {run!r} of namespace {namespace!r} "
                f"({self.run_folder(namespace, run)}/). A NO_UPLOAD checkpoint lies in its "
                "own run's folder, or outside the storage root (registered where it is and "
                "never deleted by retention). Nothing was written."
            )
        if not self.fs.isdir(path):
            raise CheckpointNotFound(uri, "no directory there")
        try:
            present, folders = self._stored_tree(path)
        except _UnsafeFolder as exc:
            raise InvalidInput(
                f"Checkpoint {uri!r} cannot be registered in place: {exc}. Nothing was "
                "written. Replace the link with the files it points to."
            ) from None
        return path, present, folders

    def write_manifest(self, directory: str, files: dict) -> bytes:
        """Writes the manifest of files already in ``directory`` (an assembled checkpoint)."""
        return self._write_manifest(directory, files)

    def _write_manifest(self, directory: str, files: dict, folders=(), replace=False) -> bytes:
        """Writes the manifest (``replace``: over one written in place before)."""
        for rel in [*files, *folders]:
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise InvalidInput(
                    f"Checkpoint file {rel!r} cannot be listed in a manifest: {problem}. "
                    "Rename it; nothing was registered."
                )
        manifest = Manifest(files, tuple(folders), algorithm_of(files)).to_bytes()
        target = posixpath.join(directory, MANIFEST_NAME)
        if not self.is_local:
            with self.fs.open(target, "wb") as f:
                f.write(manifest)
            return manifest
        if replace and os.path.lexists(target):
            os.unlink(target)  # a manifest written in place before: never written through
        with create_private_file(target) as f:
            f.write(manifest)
        return manifest

    def persisted(self, path: str, files: dict, manifest: bytes) -> PersistedCheckpoint:
        """The record of a checkpoint stored at ``path`` with these files and manifest."""
        digest = hashlib.sha256(manifest).hexdigest()
        return PersistedCheckpoint(self.uri_for(path), Manifest(files).total_size, digest)

    # ----------------------------------------------------------------- verify
    def read_manifest(self, uri: str, manifest_sha256: str | None) -> Manifest:
        """The checkpoint's manifest, checked against its sha256 and for unsafe entries."""
        path = self.readable_path(uri)
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
        except UnknownDigestAlgorithm as exc:
            raise InvalidInput(f"Checkpoint at {uri}: {exc} ({manifest_path}).") from None
        except ValueError as exc:
            raise CheckpointCorrupt(uri, f"{exc}; nothing was read or written") from None

    def verify(self, uri: str, manifest_sha256: str | None) -> Manifest:
        """Checks the folder holds exactly the manifest's files (and empty folders), each
        file of its size and digest (the manifest's algorithm: BLAKE3, or SHA-256 for a
        manifest of an earlier release).

        Raises CheckpointNotFound when files are missing and nothing else is wrong, and
        CheckpointCorrupt when files were added or changed; both name every such file.
        """
        manifest = self.read_manifest(uri, manifest_sha256)
        self._compare(uri, self.readable_path(uri), manifest, None)
        return manifest

    def materialize(self, uri: str, manifest_sha256: str | None, workdir: str) -> str:
        """A verified local directory with the checkpoint's files.

        Local storage is verified in place and returned as is; remote storage is
        downloaded into ``workdir`` and verified while it downloads. A folder registered
        from outside training (Registry.register: no manifest) is read as it is.
        """
        if manifest_sha256 is None and not _has_manifest(uri, self.storage_options):
            return _outside_folder_copy(uri, self.storage_options, workdir)
        if self.is_local:
            self.verify(uri, manifest_sha256)
            return self.readable_path(uri)
        manifest = self.read_manifest(uri, manifest_sha256)
        path = self.readable_path(uri)
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
            present, folders = self._stored_tree(path)
        except _UnsafeFolder as exc:
            raise CheckpointCorrupt(uri, str(exc)) from None
        # An empty folder counts as a file would: one that was no folder of the
        # checkpoint is added, a listed one that is gone is missing.
        known_folders = set(manifest.folders) | _parents(manifest.files)
        gone = set(manifest.folders) - set(folders) - _parents(present)
        missing = sorted(set(manifest.files) - set(present)) + [f"{r}/" for r in sorted(gone)]
        extra = sorted(set(present) - set(manifest.files))
        extra += [f"{rel}/" for rel in sorted(set(folders) - known_folders)]
        changed: list[str] = []
        if not (missing or extra):  # otherwise it fails anyway: read nothing
            for rel, expected in sorted(manifest.files.items()):
                out = None if target_root is None else _open_download(target_root, rel)
                try:
                    with self._open_stored(present[rel]) as f:
                        got = copy_hashing(f, out, manifest.algorithm)
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
                elif got[manifest.algorithm] != expected[manifest.algorithm]:
                    changed.append(
                        f"{rel!r} has a different {manifest.algorithm} digest than the manifest"
                    )
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

    def delete(self, uri: str, *, namespace: str, run: str) -> None:
        """Removes a checkpoint's folder, which must lie inside its own run's folder
        (``<root>/<namespace>/<run>/``); raises InvalidInput, deleting nothing, otherwise."""
        path = self.path_of(uri)
        if not self.in_run_folder(uri, namespace, run):
            raise InvalidInput(
                f"Checkpoint {uri!r} is not inside the folder of run {run!r} of namespace "
                f"{namespace!r} ({self.run_folder(namespace, run)}/): ckval deletes nothing "
                "outside a checkpoint's own run. Nothing was deleted."
            )
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def _stored_tree(self, path: str) -> tuple[dict[str, str], list[str]]:
        """Relative path -> full path of every file of a stored folder but its manifest,
        and its empty folders (local storage only: object stores have no folders).

        Raises _UnsafeFolder for a local symlink that leads out of the folder, and for a
        remote key that is no plain relative path.
        """
        if self.is_local:
            files, folders = _local_tree(path)
            return dict(files), folders
        self.fs.invalidate_cache(path)  # an extra file added since the last listing counts
        found = {}
        prefix = path.rstrip("/") + "/"
        for full in sorted(self.fs.find(path)):
            rel = full[len(prefix) :] if full.startswith(prefix) else full
            problem = manifest_entry_problem(rel)
            if problem is not None:
                raise _UnsafeFolder(f"it holds the key {full!r}, {problem}")
            if rel != MANIFEST_NAME:
                found[rel] = full
        return found, []

    def _open_stored(self, full: str):
        # Local files are opened as found (symlinks inside the folder already resolved).
        return open(full, "rb", buffering=0) if self.is_local else self.fs.open(full, "rb")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _open_download(target_root: str, rel: str):
    """Creates the file ``rel`` under ``target_root`` for writing; never one elsewhere."""
    target = os.path.join(target_root, rel)
    # Entries were checked when the manifest was read; resolving again costs nothing.
    if not os.path.realpath(target).startswith(os.path.realpath(target_root) + os.sep):
        raise InvalidInput(f"manifest entry {rel!r} would be written outside {target_root}")
    make_private_folders(os.path.dirname(target))
    return create_private_file(target)


def _listed(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def ray_checkpoint(uri: str, storage_options: dict[str, Any] | None = None):
    """A ray.train.Checkpoint for a stored checkpoint, read through fsspec."""
    from ray.train import Checkpoint

    fs, path = _filesystem(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        return Checkpoint(path)
    import pyarrow.fs

    return Checkpoint(path, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))
