"""The database layer: engine, read, write and one-statement transactions, schema
revision, disconnects.

It knows neither Settings nor Ray; the room that owns an operation (Registry, Ledger,
JobQueue...) opens its transaction here and runs the catalog's, the queue's and the
transitions' statements in it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    StatementError,
)
from sqlalchemy.orm import Session, sessionmaker

from validation_service import retry
from validation_service._home import ENV_PREFIX
from validation_service.errors import (
    InvalidInput,
    InvalidSettings,
    RegistryRejected,
    RegistryUnavailable,
    SchemaOutOfDate,
)
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


def _printable_url(url: str) -> str:
    """masked_url, also for a URL too malformed to parse."""
    try:
        return masked_url(url)
    except Exception:  # noqa: BLE001 - unparseable: mask what looks like a password
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", str(url))


def open_engine(url: str, source: str) -> Engine:
    """The registry's engine; a URL that names no usable database raises InvalidSettings
    (InvalidInput for an explicit argument) naming ``source`` and the masked URL."""
    error = InvalidSettings if source.startswith(ENV_PREFIX) else InvalidInput
    example = "sqlite:////path/to/registry.db or postgresql+psycopg://user:password@host:5432/db"
    try:
        parsed = make_url(url)
        port = parsed.port
    except (ArgumentError, ValueError, TypeError) as exc:
        raise error(
            f"{source} is not a database URL ({_printable_url(url)}: {exc}). Use e.g. {example}."
        ) from None
    if port is not None and not 0 < port < 65536:
        raise error(
            f"{source} has port {port}, which is not a TCP port (1-65535): "
            f"{_printable_url(url)}. Use e.g. {example}."
        )
    try:
        return create_registry_engine(url)
    except (NoSuchModuleError, ImportError) as exc:
        raise error(
            f"{source} names a database ckval cannot open ({_printable_url(url)}: {exc}). "
            f"Use e.g. {example}."
        ) from None
    except OSError as exc:
        raise error(
            f"{source}: the SQLite registry's folder cannot be created "
            f"({_printable_url(url)}: {exc}). Point it at a writable folder."
        ) from None


class Database:
    """One registry database: an engine for reads, one for writes, and its schema.

    ``source`` names where the URL came from (``CKVAL_DATABASE_URL``, ``CKVAL_HOME``, the
    ``database_url`` argument), for the errors that say what to fix.
    """

    def __init__(self, url: str, *, source: str = "the database_url argument"):
        self.url = url
        self.source = source
        self.engine = open_engine(url, source)
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
    def one_statement(self) -> Iterator[Connection]:
        """A connection for a write of exactly one statement, which is its own transaction.

        PostgreSQL runs a single statement atomically by itself: in autocommit it costs
        one round trip instead of three (BEGIN, the statement, COMMIT). SQLite takes its
        write lock as write() does (its round trips are function calls).
        """
        if self.dialect != "postgresql":
            with self.write() as connection:
                yield connection
            return
        with self.autocommit() as connection:
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
        """Driver errors as ckval's: an outage is RegistryUnavailable (retried by the
        callers that may), an error of the statement is RegistryRejected (never retried).

        IntegrityError passes as it is: the catalog and the registry read a unique-key
        violation as "registered before" and turn any other into RegistryRejected.
        """
        try:
            yield
        except (UnicodeEncodeError, StatementError) as exc:
            text = _unstorable_text(exc)
            if text is not None:
                raise InvalidInput(
                    f"The text {text!r} holds a character no registry can store (a lone "
                    "surrogate, which is what bytes that are not UTF-8 decode to): pass "
                    "names and values as UTF-8 text. Nothing was stored."
                ) from None
            if not isinstance(exc, DBAPIError) or isinstance(
                exc, (RegistryUnavailable, IntegrityError)
            ):
                raise
            if retry.is_transient_database_error(exc):
                error = RegistryUnavailable(self.display_url, exc, source=self.source)
                error.disconnect = retry.should_rerun(exc)
                raise error from exc
            raise RegistryRejected(self.display_url, exc) from exc

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
        raise SchemaOutOfDate(
            f"The registry database {self.display_url} is at schema revision "
            f"{current or 'none (empty)'}, this ckval needs {head}. "
            "Run `ckval db upgrade` (with CKVAL_DATABASE_URL set) to migrate it."
        )

    def upgrade(self, revision: str = "head") -> None:
        with self._unavailable_as_error():
            _migrate.upgrade(self.engine, self.url, revision)

    def downgrade(self, revision: str) -> None:
        with self._unavailable_as_error():
            _migrate.downgrade(self.engine, self.url, revision)

    def schema_revision(self) -> str | None:
        with self._unavailable_as_error():
            return _migrate.current_revision(self.engine)

    def is_sqlite(self) -> bool:
        return is_sqlite(self.url)

    def close(self) -> None:
        self.engine.dispose()


def _unstorable_text(exc: BaseException) -> str | None:
    """The text a driver could not encode (a str with a lone surrogate), or None when
    ``exc`` is another error."""
    cause = getattr(exc, "orig", exc)
    if isinstance(cause, UnicodeEncodeError) and isinstance(cause.object, str):
        return cause.object
    return None


def retry_on_disconnect(method: _F) -> _F:
    """Retries an idempotent Registry operation when the database connection drops.

    A restarted or failed-over server, or a terminated backend, ends the connection
    mid-transaction; the pool reconnects (pre-ping) and the operation runs again. A
    serialization failure or a deadlock runs it again too (retry.should_rerun); an
    error of the statement itself (RegistryRejected) never does.
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
