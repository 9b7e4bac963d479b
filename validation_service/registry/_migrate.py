"""Runs the Alembic migrations in migrations/ against a registry database."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from validation_service.registry._engine import WRITE_OPTION, schema_lock

_PACKAGE = Path(__file__).resolve().parents[1]


def migrations_dir() -> Path:
    """The Alembic scripts: validation_service/migrations in an installed distribution
    (pyproject.toml maps the repository's top-level migrations/ there), else the
    repository's migrations/ beside validation_service/."""
    installed = _PACKAGE / "migrations"
    if (installed / "env.py").is_file():
        return installed
    return _PACKAGE.parent / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, url: str, revision: str = "head") -> None:
    _migrate(engine, url, command.upgrade, revision)


def downgrade(engine: Engine, url: str, revision: str) -> None:
    _migrate(engine, url, command.downgrade, revision)


def _migrate(engine: Engine, url: str, run, revision: str) -> None:
    with schema_lock(url):
        config = alembic_config(url)
        with engine.execution_options(**{WRITE_OPTION: True}).connect() as connection:
            with _sqlite_foreign_keys_off(connection):
                with connection.begin():
                    config.attributes["connection"] = connection
                    run(config, revision)
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
    driver.execute("PRAGMA foreign_keys=OFF")
    try:
        yield
    finally:
        driver.execute("PRAGMA foreign_keys=ON")


def _check_foreign_keys(connection: Connection) -> None:
    """Refuses (rolls back) a SQLite migration that left a row pointing nowhere."""
    if connection.dialect.name != "sqlite":
        return
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RuntimeError(f"migration left rows with broken foreign keys: {broken[:5]}")
