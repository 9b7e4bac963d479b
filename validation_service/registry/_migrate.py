"""Runs the Alembic migrations in migrations/ against a registry database.

Checking a schema (every Registry() does) needs no Alembic: the head revision is read
from the scripts' ``revision``/``down_revision`` lines (_revisions.py) and the current
one from the ``alembic_version`` table. Alembic loads only to migrate, or when the
scripts are not plain enough to read that way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, column, inspect, select, table

from validation_service.registry import raw_sql
from validation_service.registry._engine import WRITE_OPTION, schema_lock
from validation_service.registry._revisions import declared_heads, migrations_dir

if TYPE_CHECKING:
    from alembic.config import Config

_VERSION_TABLE = table("alembic_version", column("version_num"))
# The revisions stamped (the CLI's fast read runs it too, see _fast_sql_source.py).
VERSIONS_QUERY = select(_VERSION_TABLE.c.version_num)


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision(url: str) -> str | None:
    heads = declared_heads(migrations_dir() / "versions")
    if heads is not None and len(heads) == 1:
        return heads[0]
    # Several heads, or a script this reader cannot follow: Alembic decides (and says
    # what is wrong with several heads).
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        if not inspect(connection).has_table(_VERSION_TABLE.name):
            return None
        versions = connection.execute(VERSIONS_QUERY).scalars().all()
        if len(versions) <= 1:
            return versions[0] if versions else None
        # Several heads stamped: Alembic's own error says what to do.
        from alembic.runtime.migration import MigrationContext

        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, url: str, revision: str = "head") -> None:
    from alembic import command

    _migrate(engine, url, command.upgrade, revision)


def downgrade(engine: Engine, url: str, revision: str) -> None:
    from alembic import command

    _migrate(engine, url, command.downgrade, revision)


# Alembic keeps its running migration in module state (alembic.context, op): two threads
# of one process migrating at once, even two databases, would meet in it.
_ALEMBIC = threading.Lock()


def _migrate(engine: Engine, url: str, run, revision: str) -> None:
    from alembic.util import CommandError

    from validation_service.errors import InvalidInput

    with _ALEMBIC, schema_lock(url):
        config = alembic_config(url)
        with engine.execution_options(**{WRITE_OPTION: True}).connect() as connection:
            with _sqlite_foreign_keys_off(connection):
                with connection.begin():
                    config.attributes["connection"] = connection
                    try:
                        run(config, revision)
                    except CommandError as exc:
                        raise InvalidInput(
                            f"Cannot migrate the registry to revision {revision!r}: {exc}. "
                            "Give 'head', 'base' or a revision of migrations/versions; "
                            "`ckval db current` prints the current one. Nothing changed."
                        ) from None
                    _check_foreign_keys(connection)


@contextlib.contextmanager
def _sqlite_foreign_keys_off(connection: Connection) -> Iterator[None]:
    """SQLite rebuilds a table to change its constraints (a copy, then DROP TABLE of the
    old one); with foreign keys on, that DROP would cascade to the rows that refer to it.
    The pragma only takes effect outside a transaction, so it is set before BEGIN, on
    the driver's connection (a statement through SQLAlchemy would begin one first)."""
    if connection.dialect.name != "sqlite":
        yield
        return
    driver = connection.connection.driver_connection
    driver.execute(raw_sql.SQLITE_FOREIGN_KEYS_OFF)
    try:
        yield
    finally:
        driver.execute(raw_sql.SQLITE_FOREIGN_KEYS_ON)


def _check_foreign_keys(connection: Connection) -> None:
    """Refuses (rolls back) a SQLite migration that left a row pointing nowhere."""
    if connection.dialect.name != "sqlite":
        return
    broken = connection.exec_driver_sql(raw_sql.SQLITE_FOREIGN_KEY_CHECK).fetchall()
    if broken:
        raise RuntimeError(f"migration left rows with broken foreign keys: {broken[:5]}")
