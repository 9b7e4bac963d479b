"""The service's watched folders: on a thread of its own, each replica claims the watches
that are due (one replica per watch and listing, registry/watch_listings.py), lists each
folder, and records what it found; a ready step folder becomes a checkpoint with its
validation, and the scheduler is woken to claim it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable

from validation_service.config import Settings
from validation_service.jobs import WatchedFolderState
from validation_service.registry.models import utcnow
from validation_service.registry.watch_listings import (
    ClaimedWatch,
    FolderUpdate,
    Taken,
    WatchBook,
)
from validation_service.signing import PayloadTrust
from validation_service.storage import CheckpointStorage
from validation_service.watching import (
    ReadyRule,
    WatchedLocation,
    is_ready,
    is_step_folder_name,
    step_of,
)

logger = logging.getLogger(__name__)

WAITING = WatchedFolderState.WAITING.value
# The longest a stopped or idle watcher thread sleeps between looks at the registry.
MAX_NAP_S = 1.0


class FolderWatcher:
    """Lists the registry's due watches on a thread of its own (``start``/``stop``), so
    that a slow listing (a bucket of many step folders) never holds up the claims of
    validation jobs. ``on_registered`` is called when a listing queued validations."""

    def __init__(
        self,
        book: WatchBook,
        settings: Settings,
        owner: str,
        on_registered: Callable[[], None] = lambda: None,
    ):
        self.book = book
        self.settings = settings
        self.owner = owner
        self.on_registered = on_registered
        self.stats = {"listings": 0, "registered": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trust: PayloadTrust | None = None

    def start(self, owner_prefix: str | None = None) -> FolderWatcher:
        """Starts listing; first gives back the watches an earlier incarnation of this
        replica (``owner_prefix``) held, as the scheduler does with its jobs."""
        if owner_prefix is not None:
            try:
                self.book.release_leases(owner_prefix, keep_owner=self.owner)
            except Exception:  # noqa: BLE001 - the leases also expire on their own
                logger.warning("releasing earlier watch leases failed", exc_info=True)
        self._thread = threading.Thread(target=self._loop, name="ckval-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        nap = min(self.settings.watch_interval_s, MAX_NAP_S)
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a database blip must not end the watching
                logger.exception("listing watched folders failed; retrying")
            self._stop.wait(nap)

    def tick(self) -> int:
        """Lists every watch that is due and this replica could claim; returns how many
        step folders it registered."""
        registered = 0
        for watch in self.book.claim_due(self.owner, lease_s=self.settings.lease_s):
            registered += self.list_watch(watch)
        if registered:
            self.on_registered()
        return registered

    @property
    def trust(self) -> PayloadTrust:
        if self._trust is None:
            self._trust = PayloadTrust.from_settings(self.settings)
        return self._trust

    def list_watch(self, watch: ClaimedWatch) -> int:
        """One listing of a claimed watch, recorded; returns the step folders registered."""
        self.stats["listings"] += 1
        now = utcnow()
        next_at = now + dt.timedelta(seconds=self.settings.watch_interval_s)
        try:
            location = WatchedLocation.open(watch.uri, self.settings.storage_options)
            updates, error = self._look(location, watch, now)
        except Exception as exc:  # noqa: BLE001 - recorded with the watch, listed again
            location, updates = None, []
            error = f"{watch.uri} could not be listed ({type(exc).__name__}: {exc})"
        if error:
            logger.warning("watch %s: %s", watch.id, error)
        taken = self.book.record_listing(
            watch,
            updates,
            trust=self.trust,
            next_listing_at=next_at,
            error=error,
            release=not watch.copy,
        )
        if taken is None:
            return 0  # another replica holds the watch now
        registered = sum(1 for t in taken if t.job_id is not None)
        if watch.copy:
            registered = self._copy_all(watch, location, taken, next_at, error)
        self.stats["registered"] += registered
        return registered

    def _look(
        self, location: WatchedLocation, watch: ClaimedWatch, now: dt.datetime
    ) -> tuple[list[FolderUpdate], str | None]:
        """The step folders not registered yet as they look now, and what was wrong."""
        rule = ReadyRule.parse(watch.ready)
        updates, unnamed = [], []
        for name in location.folder_names():
            if not is_step_folder_name(name, watch.pattern):
                continue
            step = step_of(name)
            seen = watch.seen.get(name)
            if step is None:
                unnamed.append(name)
                continue
            if seen is not None and seen.state != WAITING:
                continue  # registered (or being copied) already
            try:
                look = location.look(name)
            except FileNotFoundError:
                continue  # removed between the two listings
            same = seen is not None and seen.fingerprint == look.fingerprint
            changed_at = seen.changed_at if same else now
            unchanged = (now - seen.changed_at).total_seconds() if same else None
            ready = is_ready(rule, look, unchanged, self.settings.watch_settle_s)
            uri = location.child_uri(name)
            updates.append(
                FolderUpdate(name, uri, step, look.fingerprint, changed_at, look.size_bytes, ready)
            )
        error = None
        if unnamed and watch.pattern is not None:
            error = (
                f"step folders matching {watch.pattern!r} with no integer in their names were "
                f"left out: {', '.join(repr(n) for n in unnamed[:10])}"
            )
        return updates, error

    def _copy_all(self, watch, location, taken: list[Taken], next_at, error) -> int:
        """A watch with copy=True: each taken step folder copied into storage and
        registered there; then the watch's lease given back."""
        registered = 0
        for took in taken:
            try:
                stored = self._copy(watch, location, took)
            except Exception as exc:  # noqa: BLE001 - copied again at the next listing
                error = (
                    f"step folder {took.name!r} could not be copied into ckval's storage "
                    f"({type(exc).__name__}: {exc}); it is tried again at the next listing"
                )
                logger.warning("watch %s: %s", watch.id, error)
                continue
            if self.book.register_copy(watch, took, stored, self.trust) is not None:
                registered += 1
        self.book.release(watch, next_at, error)
        return registered

    def _copy(self, watch: ClaimedWatch, location: WatchedLocation | None, took: Taken):
        """The step folder copied to its report index's folder in ckval's storage (over
        what an interrupted copy left there)."""
        if location is None:
            raise FileNotFoundError(watch.uri)
        settings = self.settings
        storage = CheckpointStorage(settings.resolved_storage(), settings.storage_options)
        ns, run = watch.namespace, watch.run
        dest = storage.checkpoint_path(ns, run, took.report_index, attempt=took.attempt)
        if storage.fs.exists(dest):
            storage.delete(storage.uri_for(dest), namespace=ns, run=run)
        source = location.path.rstrip("/") + "/" + took.name
        if not location.fs.isdir(source):
            raise FileNotFoundError(
                f"{took.uri} is gone: the trainer deleted it before ckval copied it"
            )
        if location.uri == location.path:  # a local folder
            return storage.upload(source, ns, run, took.report_index, attempt=took.attempt)
        workdir = tempfile.mkdtemp(prefix="ckval-watch-")
        try:
            local = os.path.join(workdir, "step")
            location.fs.get(source + "/", local + "/", recursive=True)
            return storage.upload(local, ns, run, took.report_index, attempt=took.attempt)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
