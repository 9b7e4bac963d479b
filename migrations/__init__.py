"""Alembic environment and numbered versions: the only way the registry schema changes.

Installed as ``validation_service.migrations`` (see pyproject.toml), not as a top-level
package of its own.
"""
