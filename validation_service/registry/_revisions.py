"""The migration scripts' folder and their head revision, read without Alembic or
SQLAlchemy: the schema check of every Registry() and the CLI's fast read path use it."""

from __future__ import annotations

import ast
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def migrations_dir() -> Path:
    """The Alembic scripts: validation_service/migrations in an installed distribution
    (pyproject.toml maps the repository's top-level migrations/ there), else the
    repository's migrations/ beside validation_service/."""
    installed = _PACKAGE / "migrations"
    if (installed / "env.py").is_file():
        return installed
    return _PACKAGE.parent / "migrations"


def declared_heads(versions: Path) -> list[str] | None:
    """The revisions no script revises, read from the scripts' literal assignments.

    None when a script does not assign ``revision`` and ``down_revision`` literals.
    """
    revisions: set[str] = set()
    revised: set[str] = set()
    for script in sorted(versions.glob("*.py")):
        if script.name == "__init__.py":
            continue
        assigned = _literal_assignments(script, {"revision", "down_revision"})
        if assigned is None or not isinstance(assigned.get("revision"), str):
            return None
        revisions.add(assigned["revision"])
        down = assigned.get("down_revision", ())
        if isinstance(down, str):
            revised.add(down)
        elif isinstance(down, (tuple, list)):
            revised.update(down)
        elif down is not None:
            return None
    return sorted(revisions - revised)


def _literal_assignments(script: Path, names: set[str]) -> dict[str, object] | None:
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in names:
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                return None
    return found
