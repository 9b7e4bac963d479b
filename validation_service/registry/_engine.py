"""Engine construction: SQLite pragmas and write locking, NaN-safe JSON, schema locks, and
owner-only files for the embedded registry (it holds the pickled validate_fns)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from validation_service._home import PRIVATE_FILE_MODE, make_private_folders
from validation_service.metrics import decode_non_finite, encode_non_finite
from validation_service.registry import raw_sql

WRITE_OPTION = "ckval_write"


def json_dumps(value: Any) -> str:
    return json.dumps(encode_non_finite(value), allow_nan=False)


def json_loads(text: str | bytes) -> Any:
    """A JSON column's value (text from SQLite, bytes from psycopg), non-finite decoded."""
    # Most stored JSON holds no non-finite value: then the walk over every value (2/3 of
    # reading a run of 1000 metrics per checkpoint) is skipped. json_dumps writes them as
    # the plain strings "NaN", "Infinity" and "-Infinity", which this test always finds.
    markers = _NON_FINITE_BYTES if isinstance(text, bytes) else _NON_FINITE_TEXT
    if not any(marker in text for marker in markers):
        return json.loads(text)
    return decode_non_finite(json.loads(text))


_NON_FINITE_TEXT = ("NaN", "Infinity")
_NON_FINITE_BYTES = (b"NaN", b"Infinity")


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
            create_private_file(path)
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


def create_private_file(path: Path) -> None:
    """Creates the SQLite file (and the folders to it) for its owner only; an existing file
    or folder keeps its mode. The registry holds payloads that are unpickled when a
    validation runs; SQLite gives its -wal, -shm and -journal files the database's mode."""
    make_private_folders(path.parent)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, PRIVATE_FILE_MODE))
    except FileExistsError:
        return


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Take transactions into our hands (pysqlite's own BEGIN is deferred, which lets
        # two writers both read and then deadlock on upgrade to a write lock).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in raw_sql.SQLITE_CONNECTION_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        if connection.get_execution_options().get(WRITE_OPTION):
            # BEGIN IMMEDIATE takes the write lock up front: claim-then-update is atomic
            # across processes, the SQLite stand-in for FOR UPDATE SKIP LOCKED.
            connection.exec_driver_sql(raw_sql.SQLITE_BEGIN_WRITE)
        else:
            # Reads never block writers (or wait for them) in WAL mode.
            connection.exec_driver_sql(raw_sql.SQLITE_BEGIN_READ)


class SQLiteWriteLock:
    """Queues this process's and other processes' writers to one SQLite file.

    SQLite's own busy handler sleeps in steps of up to 100 ms while another writer
    holds the lock; a file lock hands over the moment the holder is done.
    """

    def __init__(self, path: Path):
        self._thread_lock = threading.Lock()
        self._path = str(path) + ".write.lock"
        self._fd: int | None = None

    def __enter__(self):
        self._thread_lock.acquire()
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, PRIVATE_FILE_MODE)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()


def write_lock(url: str):
    """The lock write transactions take first: a file lock for SQLite, none for servers."""
    path = sqlite_path(url) if is_sqlite(url) else None
    return SQLiteWriteLock(path) if path is not None else contextlib.nullcontext()


@contextlib.contextmanager
def schema_lock(url: str):
    """Serialises schema upgrades of one SQLite file across processes."""
    path = sqlite_path(url) if is_sqlite(url) else None
    if path is None:
        yield
        return
    lock_path = str(path) + ".migrate.lock"
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
