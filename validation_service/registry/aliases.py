"""Aliases and tags of checkpoints: named pointers that move in one statement, string tags
(as MLflow's), and the rules that keep an alias on a run's best checkpoint. Reads and
writes checkpoint_aliases, tracked_aliases and checkpoint_tags; a tag filter also reads
the tags of each checkpoint's run."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, exists, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from validation_service.errors import AliasNotFound, InvalidInput
from validation_service.registry.limits import IDS_PER_IN_LIST
from validation_service.registry.models import (
    Checkpoint,
    CheckpointAlias,
    CheckpointTag,
    Run,
    TrackedAlias,
    utcnow,
)
from validation_service.registry.records import CheckpointRecord
from validation_service.validation import INT32_MAX

# The checkpoint's run, under a name of its own: the queries a tag filter joins may have
# joined runs already, and the filter's EXISTS must not correlate with that join.
_tagged_run = Run.__table__.alias("tagged_run")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
MAX_TAG_VALUE = 1000


def check_alias(alias: str) -> None:
    if not isinstance(alias, str) or not _NAME.fullmatch(alias):
        raise InvalidInput(
            f"alias {alias!r} is not allowed: use 1 to 255 letters, digits, '_', '-' or "
            "'.', starting with a letter, digit or '_' (e.g. 'best', 'production')"
        )


def check_tag(key: str, value: str | None) -> None:
    if not isinstance(key, str) or not _NAME.fullmatch(key):
        raise InvalidInput(
            f"tag key {key!r} is not allowed: use 1 to 255 letters, digits, '_', '-' or "
            "'.', starting with a letter, digit or '_' (e.g. 'split', 'dataset.version')"
        )
    if value is not None and not isinstance(value, str):
        raise InvalidInput(
            f"tag {key!r} has value {value!r} of type {type(value).__name__}; tag values "
            "are strings (as MLflow's): pass str(value)"
        )
    if value is not None and len(value) > MAX_TAG_VALUE:
        raise InvalidInput(
            f"tag {key!r} has a value of {len(value)} characters; at most {MAX_TAG_VALUE} "
            "are stored. Store a URI or a digest of a longer value instead."
        )


def check_tag_filter(tags: Any) -> dict[str, str]:
    if not isinstance(tags, dict):
        raise InvalidInput(f"tags must be a dict of str to str, got {type(tags).__name__}")
    for key, value in tags.items():
        if value is None:
            raise InvalidInput(f"tag filter {key!r} has no value; give the value to match")
        check_tag(key, value)
    return tags


def tag_conditions(tags: dict[str, str]) -> list[Any]:
    """WHERE clauses on checkpoints: every key = value of ``tags`` is set on the
    checkpoint, or on its run. A run's tags hold for each of its checkpoints: the Ray Tune
    trial of a run (``tune_experiment``, ``tune_trial_id``) is a tag of the run, so that
    ``best_checkpoints(None, metric, tags={"tune_experiment": ...})`` ranks a search."""
    check_tag_filter(tags)
    return [
        or_(
            exists().where(
                CheckpointTag.checkpoint_id == Checkpoint.id,
                CheckpointTag.key == key,
                CheckpointTag.value == value,
            ),
            exists().where(
                _tagged_run.c.id == Checkpoint.run_id, _tagged_run.c.tags[key].as_string() == value
            ),
        )
        for key, value in tags.items()
    ]


def upsert(conn: Connection, table, row: dict[str, Any], keys: list[str]) -> None:
    """INSERT ... ON CONFLICT (keys) DO UPDATE: one statement, atomic on both databases."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(table).values(row)
    changed = {name: statement.excluded[name] for name in row if name not in keys}
    conn.execute(statement.on_conflict_do_update(index_elements=keys, set_=changed))


def put_or_remove(
    conn: Connection, table, keys: dict[str, Any], values: dict[str, Any] | None
) -> None:
    """The row of ``keys`` set to ``values`` (an upsert), or removed when ``values`` is None."""
    if values is None:
        conn.execute(delete(table).where(*(table.c[k] == v for k, v in keys.items())))
    else:
        upsert(conn, table, {**keys, **values}, list(keys))


def live_checkpoint_id(conn: Connection, run_id: int, run: str, report_index: int) -> int:
    """The id of a checkpoint that is not deleted, locked until the transaction ends (so
    retention cannot delete it meanwhile); InvalidInput naming what exists otherwise."""
    if not isinstance(report_index, int) or isinstance(report_index, bool):
        raise InvalidInput(f"report_index must be an int, got {report_index!r}")
    # An index outside the column's range names no checkpoint (and never reaches the driver).
    row = None
    if 0 <= report_index <= INT32_MAX:
        row = conn.execute(
            select(Checkpoint.id, Checkpoint.deleted_at)
            .where(Checkpoint.run_id == run_id, Checkpoint.report_index == report_index)
            .with_for_update()
        ).first()
    if row is None:
        raise InvalidInput(
            f"run {run!r} has no checkpoint with report index {report_index}; "
            f"`ckval checkpoints {run}` lists them"
        )
    if row.deleted_at is not None:
        raise InvalidInput(
            f"checkpoint {report_index} of run {run!r} was deleted at "
            f"{row.deleted_at.isoformat()} (its files are gone); pick another report index"
        )
    return row.id


def set_alias(conn: Connection, run_id: int, alias: str, checkpoint_id: int) -> None:
    upsert(
        conn,
        CheckpointAlias.__table__,
        {"run_id": run_id, "alias": alias, "checkpoint_id": checkpoint_id, "updated_at": utcnow()},
        ["run_id", "alias"],
    )


def alias_not_found(session: Session, run_id: int, run: str, alias: str) -> AliasNotFound:
    """The error for an alias the run attempt does not have, naming those it has."""
    known = session.scalars(
        select(CheckpointAlias.alias)
        .where(CheckpointAlias.run_id == run_id)
        .order_by(CheckpointAlias.alias)
    ).all()
    return AliasNotFound(run, alias, list(known))


def run_aliases(session: Session, run_id: int) -> dict[str, int]:
    """Alias -> report index of the checkpoint it points at, for one run attempt."""
    rows = session.execute(
        select(CheckpointAlias.alias, Checkpoint.report_index)
        .join(Checkpoint, Checkpoint.id == CheckpointAlias.checkpoint_id)
        .where(CheckpointAlias.run_id == run_id)
        .order_by(CheckpointAlias.alias)
    )
    return dict(rows.all())


def remove_alias(conn: Connection, run_id: int, alias: str) -> bool:
    deleted = conn.execute(
        delete(CheckpointAlias).where(
            CheckpointAlias.run_id == run_id, CheckpointAlias.alias == alias
        )
    ).rowcount
    conn.execute(
        delete(TrackedAlias).where(TrackedAlias.run_id == run_id, TrackedAlias.alias == alias)
    )
    return bool(deleted)


def track_alias(conn: Connection, run_id: int, alias: str, metric: str, mode: str) -> None:
    upsert(
        conn,
        TrackedAlias.__table__,
        {"run_id": run_id, "alias": alias, "metric": metric, "mode": mode},
        ["run_id", "alias"],
    )


def tracking_rules(conn: Connection | Session, run_id: int) -> list[tuple[str, str, str]]:
    """(alias, metric, mode) of every tracked alias of the run."""
    rows = conn.execute(
        select(TrackedAlias.alias, TrackedAlias.metric, TrackedAlias.mode)
        .where(TrackedAlias.run_id == run_id)
        .order_by(TrackedAlias.alias)
    )
    return [tuple(row) for row in rows]


def set_tag(conn: Connection, checkpoint_id: int, key: str, value: str | None) -> None:
    """Sets a tag, or removes it when ``value`` is None."""
    keys = {"checkpoint_id": checkpoint_id, "key": key}
    put_or_remove(conn, CheckpointTag.__table__, keys, None if value is None else {"value": value})


def with_aliases_and_tags(
    session: Session | Connection, records: Sequence[CheckpointRecord]
) -> list[CheckpointRecord]:
    """The records with their aliases and tags filled in (two queries per
    IDS_PER_IN_LIST records)."""
    aliases: dict[int, list[str]] = {}
    tags: dict[int, dict[str, str]] = {}
    ids = [record.id for record in records]
    for start in range(0, len(ids), IDS_PER_IN_LIST):
        chunk = ids[start : start + IDS_PER_IN_LIST]
        for checkpoint_id, alias in session.execute(aliases_query(chunk)):
            aliases.setdefault(checkpoint_id, []).append(alias)
        for checkpoint_id, key, value in session.execute(tags_query(chunk)):
            tags.setdefault(checkpoint_id, {})[key] = value
    return [
        dataclasses.replace(
            record,
            aliases=tuple(aliases.get(record.id, ())),
            tags=tags.get(record.id, {}),
        )
        for record in records
    ]


def aliases_query(checkpoint_ids: Any):
    """(checkpoint id, alias) of these checkpoints, in alias order (the CLI's fast read
    runs it too, compiled with an expanding ``checkpoint_ids``)."""
    return (
        select(CheckpointAlias.checkpoint_id, CheckpointAlias.alias)
        .where(CheckpointAlias.checkpoint_id.in_(checkpoint_ids))
        .order_by(CheckpointAlias.alias)
    )


def tags_query(checkpoint_ids: Any):
    """(checkpoint id, key, value) of these checkpoints' tags, in key order (the CLI's fast
    read runs it too)."""
    return (
        select(CheckpointTag.checkpoint_id, CheckpointTag.key, CheckpointTag.value)
        .where(CheckpointTag.checkpoint_id.in_(checkpoint_ids))
        .order_by(CheckpointTag.key)
    )
