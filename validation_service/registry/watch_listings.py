"""Watched folders, the service's side: a watch claimed for one listing, what the
listing found recorded, and each ready step folder registered once with its validation.

A watch is claimed as a job is: under a lease and a new fencing token
(``WatchBook.claim_due``, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL). What a listing found
is written in one transaction that first checks the token (``record_listing``): a
replica whose lease was taken over writes nothing. ``watched_folders`` is keyed by
(watch, folder name), and a folder moves WAITING -> REGISTERED (or COPYING -> REGISTERED)
by a conditional update: each step folder becomes one checkpoint, whoever lists it and
however often the service restarts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from validation_service.jobs import DEFAULT_VALIDATOR, WatchedFolderState
from validation_service.registry import registration, transitions
from validation_service.registry.catalog import Catalog
from validation_service.registry.database import Database, retry_on_disconnect
from validation_service.registry.models import Checkpoint, Watch, WatchedFolder, utcnow
from validation_service.registry.outside_folders import external_row
from validation_service.request import ValidationRequest
from validation_service.signing import (
    VALIDATE_CONFIG,
    VALIDATE_FN,
    PayloadTrust,
    form_binding,
    job_binding,
    watch_binding,
)

_watches, _folders, _checkpoints = Watch.__table__, WatchedFolder.__table__, Checkpoint.__table__
WAITING, COPYING, REGISTERED = (s.value for s in WatchedFolderState)


@dataclasses.dataclass(frozen=True)
class SeenFolder:
    """What the registry knows of one step folder when its watch is claimed."""

    state: str
    fingerprint: str
    changed_at: dt.datetime
    report_index: int | None


@dataclasses.dataclass(frozen=True)
class ClaimedWatch:
    """A watch claimed for one listing, under ``token``; ``seen``: its step folders."""

    id: int
    namespace: str
    run: str
    uri: str
    ready: str
    pattern: str | None
    copy: bool
    token: int
    row: Any
    seen: dict[str, SeenFolder]


@dataclasses.dataclass(frozen=True)
class FolderUpdate:
    """A step folder as a listing saw it: ``ready`` to be registered now or not."""

    name: str
    uri: str
    step: int
    fingerprint: str
    changed_at: dt.datetime
    size_bytes: int
    ready: bool


@dataclasses.dataclass(frozen=True)
class Taken:
    """A step folder a listing took: registered (``job_id``) or to be copied first."""

    name: str
    uri: str
    step: int
    report_index: int
    job_id: int | None = None
    # The run attempt whose folder a copy goes into.
    attempt: int = 1


def watch_request(watch: ClaimedWatch, trust: PayloadTrust) -> ValidationRequest:
    """The watch's request with its payloads verified for the watch (nothing unpickled);
    PayloadSignatureError when they do not verify."""
    binding = watch_binding(watch.namespace, watch.run, watch.uri)
    fields = dict(watch.row.request)
    fn, config = watch.row.validate_fn_pickle, watch.row.validate_config
    if fn is not None:
        fn = trust.verify(VALIDATE_FN, fn, bound_to=binding)
    form = form_binding(binding, fields["validate_fn_ref"] if fn is None else None)
    config = trust.verify(VALIDATE_CONFIG, config, bound_to=form) if config else None
    return ValidationRequest(**fields, validate_fn_pickle=fn, validate_config=config)


# ------------------------------------------------------------ the service's side
class WatchBook:
    """The service's side of watched folders: claims, listings recorded, copies
    registered. Works across namespaces (each watch names its own)."""

    def __init__(self, db: Database):
        self.db = db

    @retry_on_disconnect
    def claim_due(self, owner: str, *, lease_s: float, limit: int = 16) -> list[ClaimedWatch]:
        """Claims live watches whose listing is due and whose lease is free or expired,
        each under a new fencing token, with the step folders each has seen."""
        now = utcnow()
        query = (
            select(_watches.c.id)
            .where(
                _watches.c.removed_at.is_(None),
                _watches.c.next_listing_at <= now,
                (_watches.c.lease_expires_at.is_(None)) | (_watches.c.lease_expires_at < now),
            )
            .order_by(_watches.c.next_listing_at, _watches.c.id)
            .limit(limit)
        )
        # A read first: the write transaction of a claim only when a watch is due, so
        # that a service without watches never contends with reporters for the write lock.
        with self.db.read() as session:
            if session.execute(query.limit(1)).first() is None:
                return []
        with self.db.write() as conn:
            if conn.dialect.name == "postgresql":
                # As a job's claim: replicas skip each other's rows instead of waiting.
                query = query.with_for_update(skip_locked=True)
            ids = list(conn.execute(query).scalars())
            if not ids:
                return []
            rows = conn.execute(
                update(_watches)
                .where(_watches.c.id.in_(ids))
                .values(
                    lease_owner=owner,
                    lease_token=_watches.c.lease_token + 1,
                    lease_expires_at=now + dt.timedelta(seconds=lease_s),
                )
                .returning(*_watches.c)
            ).all()
            return [_claimed(row, _seen(conn, row.id)) for row in rows]

    @retry_on_disconnect
    def record_listing(
        self,
        watch: ClaimedWatch,
        folders: list[FolderUpdate],
        *,
        trust: PayloadTrust,
        next_listing_at: dt.datetime,
        error: str | None,
        release: bool,
    ) -> list[Taken] | None:
        """Writes one listing of ``watch`` in one transaction: the step folders seen
        (WAITING, with their fingerprints), the ready ones taken in step order
        (registered with their jobs, or, for a watch that copies, their report indices
        reserved: COPYING), the next listing's time and ``error``; the lease is given
        back with ``release``. Returns what was taken, and the copies an earlier listing
        left unfinished (a service stopped while copying) first; None, writing nothing,
        when the token is stale."""
        now = utcnow()
        with self.db.write() as conn:
            if not _fence(conn, watch, **_listed(now, next_listing_at, error, release)):
                return None
            taken = _unfinished_copies(conn, watch, folders)
            for folder in sorted(folders, key=lambda f: (f.step, f.name)):
                _put_folder(conn, watch.id, folder, now)
                if folder.ready:
                    took = _take(conn, watch, folder, trust, now)
                    if took is not None:
                        taken.append(took)
            return taken

    @retry_on_disconnect
    def register_copy(
        self, watch: ClaimedWatch, taken: Taken, stored: Any, trust: PayloadTrust
    ) -> int | None:
        """A COPYING step folder's copy (``stored``: storage.PersistedCheckpoint)
        registered at its reserved index with its job, under the watch's lease; returns
        the job id, None when the token is stale or the folder was registered already."""
        now = utcnow()
        with self.db.write() as conn:
            if not _fence(conn, watch):
                return None
            moved = _move(conn, watch.id, taken.name, COPYING, now)
            if not moved:
                return None
            run_id = _run_id(conn, watch)
            row = external_row(
                run_id,
                taken.report_index,
                stored.uri,
                stored.size_bytes,
                _metrics(taken),
                taken.step,
            )
            row.update(manifest_sha256=stored.manifest_sha256, external=False)
            return _register(conn, watch, row, _folder_key(watch.id, taken.name), trust)

    @retry_on_disconnect
    def release_leases(self, owner_prefix: str, *, keep_owner: str) -> int:
        """Gives back the watches an earlier incarnation of a replica held (their owner
        starts with ``owner_prefix``, and is not ``keep_owner``); returns how many."""
        with self.db.write() as conn:
            return conn.execute(
                update(_watches)
                .where(
                    _watches.c.lease_owner.startswith(owner_prefix, autoescape=True),
                    _watches.c.lease_owner != keep_owner,
                )
                .values(lease_owner=None, lease_expires_at=None)
            ).rowcount

    @retry_on_disconnect
    def release(self, watch: ClaimedWatch, next_listing_at: dt.datetime, error: str | None):
        """Gives the watch's lease back (if it is still this claim's)."""
        with self.db.write() as conn:
            _fence(conn, watch, **_listed(utcnow(), next_listing_at, error, True))


def _claimed(row: Any, seen: dict[str, SeenFolder]) -> ClaimedWatch:
    return ClaimedWatch(
        id=row.id,
        namespace=row.namespace,
        run=row.run_name,
        uri=row.uri,
        ready=row.ready,
        pattern=row.pattern,
        copy=row.copy,
        token=row.lease_token,
        row=row,
        seen=seen,
    )


def _seen(conn: Connection, watch_id: int) -> dict[str, SeenFolder]:
    query = select(
        _folders.c.name,
        _folders.c.state,
        _folders.c.fingerprint,
        _folders.c.changed_at,
        _folders.c.report_index,
    ).where(_folders.c.watch_id == watch_id)
    return {row.name: SeenFolder(*row[1:]) for row in conn.execute(query)}


def _fence(conn: Connection, watch: ClaimedWatch, **values: Any) -> bool:
    """Whether this claim still holds the watch (its token, not removed), checked by an
    UPDATE (of ``values``) that also locks the row to the end of the transaction: a
    listing's writes happen under the lease or not at all."""
    values = values or {"lease_owner": watch.row.lease_owner}
    done = conn.execute(
        update(_watches)
        .where(
            _watches.c.id == watch.id,
            _watches.c.lease_token == watch.token,
            _watches.c.removed_at.is_(None),
        )
        .values(**values)
    )
    return done.rowcount == 1


def _listed(now, next_listing_at, error: str | None, release: bool) -> dict[str, Any]:
    """The watch's columns a listing sets: when it was listed, when it is next due, its
    error, and (``release``) its lease given back."""
    values: dict[str, Any] = {
        "last_error": error,
        "next_listing_at": next_listing_at,
        "last_listed_at": now,
    }
    if release:
        values.update(lease_owner=None, lease_expires_at=None)
    return values


def _put_folder(conn: Connection, watch_id: int, folder: FolderUpdate, now: dt.datetime) -> None:
    """The step folder's WAITING row, inserted or (while WAITING) brought up to date."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    row = {
        "watch_id": watch_id,
        "name": folder.name,
        "step": folder.step,
        "state": WAITING,
        "fingerprint": folder.fingerprint,
        "first_seen_at": folder.changed_at,
        "changed_at": folder.changed_at,
    }
    statement = insert(_folders).values(row)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=["watch_id", "name"],
            set_={"fingerprint": folder.fingerprint, "changed_at": folder.changed_at},
            where=_folders.c.state == WAITING,
        )
    )


def _take(
    conn: Connection, watch: ClaimedWatch, folder: FolderUpdate, trust: PayloadTrust, now
) -> Taken | None:
    """A ready WAITING step folder taken, once: registered in place with its job, or
    (copy) COPYING at a reserved report index. None when it was taken before."""
    run_id = _run_id(conn, watch)
    already = conn.scalar(
        select(_checkpoints.c.id).where(
            _checkpoints.c.run_id == run_id, _checkpoints.c.uri == folder.uri
        )
    )
    if not _move(conn, watch.id, folder.name, WAITING, now, copying=watch.copy):
        return None
    key = _folder_key(watch.id, folder.name)
    if already is not None and not watch.copy:  # registered by an earlier watch of it
        conn.execute(update(_folders).where(*key).values(checkpoint_id=already))
        return None
    index = Catalog(watch.namespace).reserve_report_index(conn, run_id)
    taken = Taken(folder.name, folder.uri, folder.step, index)
    if watch.copy:
        conn.execute(update(_folders).where(*key).values(report_index=index))
        return dataclasses.replace(taken, attempt=_attempt(conn, watch))
    row = external_row(run_id, index, folder.uri, folder.size_bytes, _metrics(taken), taken.step)
    job_id = _register(conn, watch, row, key, trust)
    return dataclasses.replace(taken, job_id=job_id)


def _move(conn: Connection, watch_id: int, name: str, state: str, now, copying=False) -> bool:
    """The step folder from ``state`` to REGISTERED (COPYING with ``copying``): the one
    conditional update that lets each step folder be taken once."""
    target = COPYING if copying else REGISTERED
    done = conn.execute(
        update(_folders)
        .where(*_folder_key(watch_id, name), _folders.c.state == state)
        .values(state=target, registered_at=now)
    )
    return done.rowcount == 1


def _register(conn: Connection, watch: ClaimedWatch, row: dict, key, trust: PayloadTrust):
    """The checkpoint row and its job, signed for this very checkpoint; returns the job
    id. The step folder's row points at the checkpoint."""
    from validation_service.payloads import signed_request

    request = watch_request(watch, trust)
    bound_to = job_binding(
        watch.namespace,
        watch.run,
        row["report_index"],
        row["uri"],
        validator=request.validator,
        job_key=transitions.idempotency_key(row["run_id"], row["report_index"]),
    )
    request = signed_request(request, trust, bound_to=bound_to)
    mirrored = request if request.validator == DEFAULT_VALIDATOR else None
    row["validation_status"] = transitions.registered_status(mirrored)
    checkpoint_id, job_id = registration.register(conn, row, request)
    conn.execute(
        update(_folders)
        .where(*key)
        .values(checkpoint_id=checkpoint_id, report_index=row["report_index"])
    )
    return job_id


def _run_id(conn: Connection, watch: ClaimedWatch) -> int:
    """The id of the watch's run's latest attempt (Registry.watch made its first)."""
    return Catalog(watch.namespace).require_run_id(conn, watch.run)


def _unfinished_copies(conn: Connection, watch: ClaimedWatch, folders) -> list[Taken]:
    """The watch's COPYING step folders, to copy again (their report indices kept)."""
    uris = {folder.name: folder.uri for folder in folders}
    unfinished = [(name, seen) for name, seen in watch.seen.items() if seen.state == COPYING]
    if not unfinished:
        return []
    attempt = _attempt(conn, watch)
    steps = dict(
        conn.execute(
            select(_folders.c.name, _folders.c.step).where(
                _folders.c.watch_id == watch.id, _folders.c.state == COPYING
            )
        ).all()
    )
    return [
        Taken(
            name,
            uris.get(name) or _child_uri(watch.uri, name),
            steps[name],
            seen.report_index,
            attempt=attempt,
        )
        for name, seen in unfinished
        if name in steps and seen.report_index is not None
    ]


def _child_uri(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _attempt(conn: Connection, watch: ClaimedWatch) -> int:
    latest = Catalog(watch.namespace).latest_attempt(conn, watch.run)
    return 1 if latest is None else latest.attempt


def _folder_key(watch_id: int, name: str) -> tuple:
    return (_folders.c.watch_id == watch_id, _folders.c.name == name)


def _metrics(taken: Taken) -> dict[str, Any]:
    return {"step": taken.step}
