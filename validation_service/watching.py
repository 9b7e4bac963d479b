"""Watched folders without the database: a watch's ready rule, a step folder's step, and
one look at a watched folder (a local path or any fsspec URI) and its step folders.

The registry keeps what a watch has seen (registry/watches.py); the service's watcher
(service/watcher.py) lists each watch periodically with these functions.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterable
from typing import Any

from validation_service.errors import InvalidInput

# What a save writes last, so that its presence means the folder is complete: DCP's
# metadata file, and the Hugging Face Trainer's state (written after the weights).
DCP_MARKER = ".metadata"
HF_TRAINER_MARKER = "trainer_state.json"
AUTO_MARKERS = (DCP_MARKER, HF_TRAINER_MARKER)
READY_FORMS = "'auto', 'marker:NAME' (e.g. 'marker:COMPLETE') or 'stable:SECONDS'"
_LAST_INTEGER = re.compile(r"(\d+)(?!.*\d)")
_MAX_STEP = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ReadyRule:
    """When a step folder is complete: ``kind`` "auto" (a DCP ``.metadata`` or a Hugging
    Face ``trainer_state.json`` in it, else settled), "marker" (the file ``marker`` in it)
    or "stable" (nothing in it changed for ``settle_s`` seconds; None: the service's
    CKVAL_WATCH_SETTLE_S)."""

    kind: str
    marker: str | None = None
    settle_s: float | None = None

    @classmethod
    def parse(cls, text: Any) -> ReadyRule:
        """The rule a ``ready=`` string names; InvalidInput saying the forms otherwise."""
        if not isinstance(text, str):
            raise InvalidInput(f"ready must be {READY_FORMS}, got {text!r}")
        kind, _, value = text.partition(":")
        if text == "auto":
            return cls("auto")
        if kind == "marker" and value and _plain_relative(value):
            return cls("marker", marker=value)
        if kind == "stable":
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if 0 < seconds < 10**7:
                return cls("stable", settle_s=seconds)
        raise InvalidInput(
            f"ready must be {READY_FORMS}, got {text!r}: a marker is a file name inside the "
            "step folder, a settling time a positive number of seconds"
        )

    @property
    def text(self) -> str:
        if self.kind == "marker":
            return f"marker:{self.marker}"
        if self.kind == "stable":
            return f"stable:{self.settle_s:g}"
        return "auto"

    def markers(self) -> tuple[str, ...]:
        """The files whose presence makes a folder ready at once."""
        return AUTO_MARKERS if self.kind == "auto" else (self.marker,) if self.marker else ()


def _plain_relative(name: str) -> bool:
    parts = name.split("/")
    return not name.startswith("/") and all(part not in ("", ".", "..") for part in parts)


def step_of(name: str) -> int | None:
    """The last integer in a folder's name (``step-100``, ``checkpoint-200``,
    ``global_step300``), or None when it has none (or one past a 64-bit step)."""
    found = _LAST_INTEGER.search(name)
    if found is None:
        return None
    step = int(found.group(1))
    return step if step <= _MAX_STEP else None


def check_pattern(pattern: Any) -> str | None:
    """A step folder name pattern (a glob such as ``step-*``), or None for any name."""
    if pattern is None:
        return None
    if not isinstance(pattern, str) or not pattern or "/" in pattern or len(pattern) > 255:
        raise InvalidInput(
            f"pattern must be a glob over the step folders' names such as 'step-*' (no '/', "
            f"at most 255 characters), got {pattern!r}"
        )
    return pattern


def is_step_folder_name(name: str, pattern: str | None) -> bool:
    """Whether a folder of the watched folder is a candidate: hidden folders (ckval's
    own staging and parts among them) never are; with a pattern, names it matches."""
    if name.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, pattern) if pattern else True


@dataclasses.dataclass(frozen=True)
class WatchedLocation:
    """A watched folder opened: its fsspec filesystem, its path there and its URI as the
    registry keeps it (a local path made absolute)."""

    fs: Any
    path: str
    uri: str

    @classmethod
    def open(cls, uri: Any, storage_options: dict[str, Any] | None = None) -> WatchedLocation:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        if not isinstance(uri, str) or not uri.strip():
            raise InvalidInput(f"watch needs the folder's path or URI as a str, got {uri!r}")
        try:
            fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except (ValueError, ImportError) as exc:
            raise InvalidInput(
                f"{uri!r} cannot be watched: {exc}. Use a local path, s3://bucket/prefix, "
                "or another URI of an installed fsspec filesystem. Nothing was registered."
            ) from None
        if isinstance(fs, LocalFileSystem):
            path = os.path.abspath(os.path.expanduser(path))
            return cls(fs, path, path)
        path = path.rstrip("/")
        return cls(fs, path, fs.unstrip_protocol(path))

    def child_uri(self, name: str) -> str:
        path = posixpath.join(self.path, name)
        return path if self.uri == self.path else self.fs.unstrip_protocol(path)

    def parent_lists(self) -> bool:
        """Whether the folder above it can be listed (an object store's bucket that
        exists, with working credentials)."""
        try:
            self.fs.ls(posixpath.dirname(self.path) or self.path, detail=False)
        except (OSError, ValueError):
            return False
        return True

    def folder_names(self) -> list[str]:
        """The names of the folders directly in it, listed afresh (no listing cache)."""
        self.fs.invalidate_cache(self.path)
        entries = self.fs.ls(self.path, detail=True)
        return sorted(
            posixpath.basename(entry["name"].rstrip("/"))
            for entry in entries
            if entry.get("type") == "directory"
        )

    def look(self, name: str) -> FolderLook:
        """The files of one step folder now: their fingerprint, size and names."""
        path = posixpath.join(self.path, name)
        self.fs.invalidate_cache(path)
        found = self.fs.find(path, detail=True)
        prefix = path.rstrip("/") + "/"
        files = {
            full[len(prefix) :]: (int(info.get("size") or 0), _modified(info))
            for full, info in found.items()
            if full.startswith(prefix)
        }
        digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
        size = sum(size for size, _ in files.values())
        return FolderLook(name, digest, size, frozenset(files))


def _modified(info: dict[str, Any]) -> str:
    """When a listed file last changed, as its filesystem says it (local: mtime; S3:
    LastModified; others: their own), for the fingerprint only."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


@dataclasses.dataclass(frozen=True)
class FolderLook:
    """A step folder as one listing saw it."""

    name: str
    fingerprint: str
    size_bytes: int
    files: frozenset[str]

    def has_any(self, markers: Iterable[str]) -> bool:
        return any(marker in self.files for marker in markers)


def is_ready(
    rule: ReadyRule, look: FolderLook, unchanged_for_s: float | None, settle_s: float
) -> bool:
    """Whether a step folder is complete by ``rule``: a marker is in it (auto, marker),
    or it looked the same for the settling time (auto without a marker, stable).
    ``unchanged_for_s``: how long its fingerprint has stayed the same (None: first seen
    now, or changed since the last listing)."""
    if rule.kind != "stable" and look.has_any(rule.markers()):
        return True
    if rule.kind == "marker":
        return False
    wait = rule.settle_s if rule.settle_s is not None else settle_s
    return unchanged_for_s is not None and unchanged_for_s >= wait


def refuse_storage_folder(location: WatchedLocation, storage: Any) -> None:
    """InvalidInput when the watched folder is ckval's storage root, holds it, or lies in
    it (a folder there is a run's, of this namespace or another: ckval writes and
    deletes there). ``storage``: a CheckpointStorage of the settings' root."""
    root = storage.root.rstrip("/")
    same_fs = type(location.fs) is type(storage.fs)
    path = location.path.rstrip("/")
    if same_fs and storage.is_local:
        path, root = os.path.realpath(path), os.path.realpath(root)
    if not same_fs:
        return
    if path == root or root.startswith(path + "/"):
        raise InvalidInput(
            f"{location.uri!r} is (or holds) ckval's storage root {storage.root_uri!r}, where "
            "every run's checkpoints lie: watch the folder your trainer saves its step "
            "folders to, outside the storage root. Nothing was registered."
        )
    if path.startswith(root + "/"):
        parts = path[len(root) + 1 :].split("/")
        owner = (
            f"the folder of run {parts[1]!r} of namespace {parts[0]!r}"
            if len(parts) >= 2
            else f"the folder of namespace {parts[0]!r}"
        )
        raise InvalidInput(
            f"{location.uri!r} lies in ckval's storage root {storage.root_uri!r}, in {owner}: "
            "ckval writes and deletes there. Have the trainer save its step folders outside "
            "the storage root, and watch that folder. Nothing was registered."
        )
