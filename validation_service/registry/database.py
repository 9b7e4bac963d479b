"""The database layer: engine, read and write transactions, schema revision, disconnects.

It knows neither Settings nor Ray; the catalog and the queue run their statements here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from validation_service.errors import RegistryUnavailable
from validation_service.registry import _migrate
from validation_service.registry._engine import (
    WRITE_OPTION,
    create_registry_engine,
    is_sqlite,
    write_lock,
)
from validation_service.secrets import mask_url

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

# About 0.3 s of retries: enough for a reconnect; longer outages are the caller's to
# handle (report() delivers in the background, the scheduler retries its next tick).
DISCONNECT_RETRIES = 5


# The one URL masker (user:password and secret query parameters), under its first name.
masked_url = mask_url


def is_locked_error(exc: BaseException) -> bool:
    return "database is locked" in str(getattr(exc, "orig", exc))


class Database:
    """One registry database: an engine for reads, one for writes, and its schema."""

    def __init__(self, url: str):
        self.url = url
        self.engine = create_registry_engine(url)
        self.dialect = self.engine.dialect.name
        self._write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._write_lock = write_lock(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def display_url(self) -> str:
        return masked_url(self.engine.url)

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads (never blocks a writer: WAL on SQLite, MVCC on PostgreSQL)."""
        with self._unavailable_as_error(), self._sessions() as session:
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A connection in one write transaction, committed on exit."""
        with (
            self._unavailable_as_error(),
            self._write_lock,
            self._write_engine.begin() as connection,
        ):
            yield connection

    @contextlib.contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A connection outside any transaction (ANALYZE and the like)."""
        with (
            self._unavailable_as_error(),
            self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection,
        ):
            yield connection

    @contextlib.contextmanager
    def _unavailable_as_error(self) -> Iterator[None]:
        try:
            yield
        except (OperationalError, InterfaceError) as exc:
            if isinstance(exc, RegistryUnavailable):
                raise
            error = RegistryUnavailable(self.display_url, exc)
            error.disconnect = _is_disconnect(exc)
            raise error from exc

    # ----------------------------------------------------------------- schema
    def check_schema(self, upgrade: bool) -> None:
        """Migrates an out-of-date schema when ``upgrade``, else raises saying how to."""
        head = _migrate.head_revision(self.url)
        current = self.schema_revision()
        if current == head:
            return
        if upgrade:
            self.upgrade()
            return
        raise RuntimeError(
            f"The registry database {self.display_url} is at schema revision "
            f"{current or 'none (empty)'}, this ckval needs {head}. "
            "Run `ckval db upgrade` (with CKVAL_DATABASE_URL set) to migrate it."
        )

    def upgrade(self, revision: str = "head") -> None:
        _migrate.upgrade(self.engine, self.url, revision)

    def downgrade(self, revision: str) -> None:
        _migrate.downgrade(self.engine, self.url, revision)

    def schema_revision(self) -> str | None:
        return _migrate.current_revision(self.engine)

    def is_sqlite(self) -> bool:
        return is_sqlite(self.url)

    def close(self) -> None:
        self.engine.dispose()


def retry_on_disconnect(method: _F) -> _F:
    """Retries an idempotent Registry operation when the database connection drops.

    A restarted or failed-over server, or a terminated backend, ends the connection
    mid-transaction; the pool reconnects (pre-ping) and the operation runs again.
    Only for operations that are safe to repeat: reads, and writes guarded by a
    unique key or a fencing token.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        delay = 0.02
        for attempt in range(1, DISCONNECT_RETRIES + 1):
            try:
                return method(self, *args, **kwargs)
            except RegistryUnavailable as exc:
                if not getattr(exc, "disconnect", False) or attempt == DISCONNECT_RETRIES:
                    raise
                logger.warning(
                    "database connection lost in %s (%s); retrying",
                    method.__name__,
                    type(exc.orig).__name__,
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    return wrapper  # type: ignore[return-value]


def _is_disconnect(exc: OperationalError | InterfaceError) -> bool:
    if exc.connection_invalidated:
        return True
    # A backend terminated by the server, or a server restarting, is a disconnect too.
    return isinstance(exc, OperationalError) and not is_locked_error(exc)
