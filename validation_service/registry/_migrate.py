"""Runs the Alembic migrations in migrations/ against a registry database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

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
    with schema_lock(url):
        config = alembic_config(url)
        with engine.execution_options(**{WRITE_OPTION: True}).begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)


def downgrade(engine: Engine, url: str, revision: str) -> None:
    with schema_lock(url):
        config = alembic_config(url)
        with engine.execution_options(**{WRITE_OPTION: True}).begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, revision)
