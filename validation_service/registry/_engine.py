"""Engine construction: SQLite pragmas and write locking, NaN-safe JSON, schema upgrades."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode_non_finite(value: Any) -> Any:
    # PostgreSQL's JSON types reject NaN/Infinity tokens, so they are stored as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _encode_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_non_finite(v) for v in value]
    return value


def _decode_non_finite(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: _decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_non_finite(v) for v in value]
    return value


def json_dumps(value: Any) -> str:
    return json.dumps(_encode_non_finite(value), allow_nan=False)


def json_loads(text: str) -> Any:
    return _decode_non_finite(json.loads(text))


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> Path | None:
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database)


def create_registry_engine(url: str) -> Engine:
    if is_sqlite(url):
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            json_serializer=json_dumps,
            json_deserializer=json_loads,
            connect_args={"timeout": 30, "check_same_thread": False},
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(
        url,
        json_serializer=json_dumps,
        json_deserializer=json_loads,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=10,
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Take transactions into our hands (pysqlite's own BEGIN is deferred, which lets
        # two writers both read and then deadlock on upgrade to a write lock).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        # BEGIN IMMEDIATE takes the write lock up front: claim-then-update is atomic
        # across processes, the SQLite stand-in for FOR UPDATE SKIP LOCKED.
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@contextlib.contextmanager
def schema_lock(url: str):
    """Serialises schema upgrades of one SQLite file across processes."""
    path = sqlite_path(url) if is_sqlite(url) else None
    if path is None:
        yield
        return
    lock_path = str(path) + ".migrate.lock"
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
