"""The warnings stored with a validation job (``validation_jobs.warnings``, a JSON list):
what went otherwise than asked though the job ran, e.g. a sink that logged its metrics to
its own tracker run instead of the one the run recorded."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from validation_service.registry.models import ValidationJob

# A job keeps at most this many warnings (the first ones), each cut to this many
# characters: a sink that warns on every retry cannot grow the row without bound.
MAX_WARNINGS_PER_JOB = 20
MAX_WARNING_CHARS = 2_000

_jobs = ValidationJob.__table__


def add_warnings(conn: Connection, job_id: int, messages: Sequence[str]) -> bool:
    """Appends ``messages`` to the job's warnings, leaving out those it has already, in
    the caller's write transaction; False when there is no such job.

    The row is locked while read (``FOR UPDATE`` on PostgreSQL; SQLite's write
    transaction holds the database), so two writers append one after the other."""
    stored = conn.execute(
        select(_jobs.c.warnings).where(_jobs.c.id == job_id).with_for_update()
    ).one_or_none()
    if stored is None:
        return False
    warnings = list(stored.warnings or ())
    for message in map(storable_warning, messages):
        if message not in warnings and len(warnings) < MAX_WARNINGS_PER_JOB:
            warnings.append(message)
    if warnings != list(stored.warnings or ()):
        conn.execute(update(_jobs).where(_jobs.c.id == job_id).values(warnings=warnings))
    return True


def storable_warning(message: str) -> str:
    """The message as every backend stores it: no NUL, no lone surrogate, not too long."""
    text = str(message)[:MAX_WARNING_CHARS]
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
