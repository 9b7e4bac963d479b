"""Watched folders, the users' side (Registry.watch, unwatch, watches): a watch checked
and stored with its validation signed for itself, ended, and listed with its step
folders registered and waiting. The service's side is watch_listings.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.errors import InvalidInput
from validation_service.jobs import WatchedFolderState
from validation_service.names import check_name
from validation_service.registry.catalog import Catalog
from validation_service.registry.evaluations import evaluation_request
from validation_service.registry.models import Watch, WatchedFolder, utcnow
from validation_service.request import ValidationRequest
from validation_service.signing import (
    VALIDATE_CONFIG,
    VALIDATE_FN,
    PayloadTrust,
    form_binding,
    watch_binding,
)
from validation_service.validation import check_flag
from validation_service.watching import (
    ReadyRule,
    WatchedLocation,
    check_pattern,
    is_step_folder_name,
    refuse_storage_folder,
    step_of,
)

_watches, _folders = Watch.__table__, WatchedFolder.__table__
REGISTERED = WatchedFolderState.REGISTERED.value
# The request's fields a watch keeps in its JSON column (the payloads have their own).
_REQUEST_FIELDS = ("executor_kind", "pool", "validate_fn_name", "validate_fn_ref", "resources")
_REQUEST_FIELDS += ("priority", "timeout_s", "max_attempts", "validator", "background")


@dataclasses.dataclass(frozen=True)
class WaitingFolder:
    """A step folder of a watch that is not ready yet: seen first at ``since``."""

    name: str
    step: int
    since: dt.datetime
    changed_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class WatchRecord:
    """A watch as Registry.watches() lists it."""

    id: int
    run: str
    namespace: str
    uri: str
    validator: str
    ready: str
    pattern: str | None
    copy: bool
    created_at: dt.datetime
    last_listed_at: dt.datetime | None
    last_error: str | None
    registered: int
    waiting: tuple[WaitingFolder, ...]
    removed_at: dt.datetime | None = None


# ------------------------------------------------------------ the users' side
def watch(registry, uri: Any, run: str, validate_fn: Any, **options: Any) -> int:
    """Registry.watch: every argument and the folder checked (it lists, it is not ckval's
    storage, a pattern's names have steps), then the watch stored, signed for itself, in
    one write transaction. ``options``: watch's keyword arguments."""
    from validation_service.payloads import signed_request
    from validation_service.storage import CheckpointStorage

    check_name("run name", run)
    rule = ReadyRule.parse(options["ready"])
    pattern = check_pattern(options["pattern"])
    copy = check_flag("copy", options["copy"])
    request = evaluation_request(
        validate_fn,
        options["validate_config"],
        options["validation_resources"],
        options["validator"],
        0,
        background=False,
    )
    settings = registry.settings
    location = WatchedLocation.open(uri, settings.storage_options)
    storage = CheckpointStorage(settings.resolved_storage(), settings.storage_options)
    refuse_storage_folder(location, storage)
    _check_names(location, pattern)
    trust = PayloadTrust.from_settings(settings)
    binding = watch_binding(registry.namespace, run, location.uri)
    stored = stored_request(signed_request(request, trust), trust, binding)
    with registry.db.write() as conn:
        return add_watch(
            conn,
            registry.namespace,
            run,
            location.uri,
            storage_root=storage.root_uri,
            ready=rule.text,
            pattern=pattern,
            copy=copy,
            **stored,
        )


def _check_names(location: WatchedLocation, pattern: str | None) -> None:
    """InvalidInput when the folder cannot be listed, or holds folders that ``pattern``
    matches without an integer in their names (no step to record)."""
    try:
        names = location.folder_names()
    except FileNotFoundError:
        if location.uri == location.path or not location.parent_lists():
            raise InvalidInput(
                f"{location.uri!r} cannot be watched: there is no such folder. Create it "
                "(or watch the folder your trainer saves its step folders to). Nothing was "
                "registered."
            ) from None
        names = []  # an object store's prefix the trainer has not written to yet
    except (OSError, ValueError) as exc:
        raise InvalidInput(
            f"{location.uri!r} cannot be listed ({type(exc).__name__}: {exc}): check the "
            "path, the credentials (CKVAL_STORAGE_OPTIONS) and the permissions. Nothing "
            "was registered."
        ) from None
    if location.fs.isfile(location.path):
        raise InvalidInput(
            f"{location.uri!r} is a file, not a folder: watch the folder your trainer saves "
            "its step folders to. Nothing was registered."
        )
    unnamed = [n for n in names if is_step_folder_name(n, pattern) and step_of(n) is None]
    if pattern is not None and unnamed:
        raise InvalidInput(
            f"{location.uri!r} holds folders that pattern {pattern!r} matches with no "
            f"integer in their names ({', '.join(repr(n) for n in unnamed[:10])}): the step "
            "is the last integer of a step folder's name. Narrow the pattern (e.g. 'step-*'). "
            "Nothing was registered."
        )


def add_watch(conn: Connection, namespace: str, run: str, uri: str, **settings: Any) -> int:
    """The new watch's id, its run made (RUNNING) if there is none; InvalidInput when a
    live watch of this folder into this run exists. ``settings``: the row's request,
    payloads, ready, pattern, copy and validator."""
    catalog = Catalog(namespace)
    if catalog.run_id(conn, run) is None:
        catalog.insert_run(
            conn, run, storage_root=settings.pop("storage_root"), tags=None, attempt=1
        )
    settings.pop("storage_root", None)
    existing = conn.scalar(_live_watch_of(namespace, run, uri))
    if existing is not None:
        raise InvalidInput(
            f"{uri!r} is watched into run {run!r} already (watch {existing}): each step "
            f"folder would be registered twice. `ckval unwatch {existing}` first to change it."
        )
    now = utcnow()
    row = {"namespace": namespace, "run_name": run, "uri": uri, **settings}
    row.update(created_at=now, next_listing_at=now, lease_token=0)
    return conn.execute(_watches.insert().returning(_watches.c.id), row).scalar_one()


def _live_watch_of(namespace: str, run: str, uri: str):
    return select(_watches.c.id).where(
        _watches.c.namespace == namespace,
        _watches.c.run_name == run,
        _watches.c.uri == uri,
        _watches.c.removed_at.is_(None),
    )


def remove_watch(conn: Connection, namespace: str, watch_id: int) -> bool:
    """Ends a live watch of the namespace (what it registered stays); False if none."""
    done = conn.execute(
        update(_watches)
        .where(
            _watches.c.id == watch_id,
            _watches.c.namespace == namespace,
            _watches.c.removed_at.is_(None),
        )
        .values(removed_at=utcnow(), lease_owner=None, lease_expires_at=None)
    )
    return done.rowcount == 1


def list_watches(session: Session, namespace: str, run: str | None) -> list[WatchRecord]:
    """The namespace's live watches (of one run), oldest first, each with its count of
    registered step folders and those still waiting."""
    query = select(_watches).where(
        _watches.c.namespace == namespace, _watches.c.removed_at.is_(None)
    )
    if run is not None:
        query = query.where(_watches.c.run_name == run)
    watches = session.execute(query.order_by(_watches.c.id)).all()
    ids = [w.id for w in watches]
    counts = dict(
        session.execute(
            select(_folders.c.watch_id, func.count())
            .where(_folders.c.watch_id.in_(ids), _folders.c.state == REGISTERED)
            .group_by(_folders.c.watch_id)
        ).all()
    )
    waiting: dict[int, list[WaitingFolder]] = {}
    pending = select(_folders).where(_folders.c.watch_id.in_(ids), _folders.c.state != REGISTERED)
    for f in session.execute(pending.order_by(_folders.c.step, _folders.c.name)):
        waiting.setdefault(f.watch_id, []).append(
            WaitingFolder(f.name, f.step, f.first_seen_at, f.changed_at)
        )
    return [_record(w, counts.get(w.id, 0), waiting.get(w.id, [])) for w in watches]


def _record(row: Any, registered: int, waiting: list[WaitingFolder]) -> WatchRecord:
    return WatchRecord(
        id=row.id,
        run=row.run_name,
        namespace=row.namespace,
        uri=row.uri,
        validator=row.validator,
        ready=row.ready,
        pattern=row.pattern,
        copy=row.copy,
        created_at=row.created_at,
        last_listed_at=row.last_listed_at,
        last_error=row.last_error,
        registered=registered,
        waiting=tuple(waiting),
        removed_at=row.removed_at,
    )


def stored_request(request: ValidationRequest, trust: PayloadTrust, binding: bytes) -> dict:
    """A watch's row fields for ``request``: its fields, and its payloads signed for the
    watch (``binding``: signing.watch_binding)."""
    fn, config = request.validate_fn_pickle, request.validate_config
    form = form_binding(binding, request.validate_fn_ref if fn is None else None)
    return {
        "request": {name: getattr(request, name) for name in _REQUEST_FIELDS},
        "validator": request.validator,
        "validate_fn_pickle": trust.sign(VALIDATE_FN, fn, bound_to=binding),
        "validate_config": trust.sign(VALIDATE_CONFIG, config, bound_to=form),
    }
