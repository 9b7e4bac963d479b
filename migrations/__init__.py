"""Alembic environment and numbered versions: the only way the registry schema changes."""

from pathlib import Path

MIGRATIONS_DIR = Path(__file__).resolve().parent
