"""The registry's raw SQL: every statement that is written as text rather than built with
``select()``, each with the reason no portable builder says it.

Everything else is built from the typed models where it is used; the CLI's fast read
runs the registry's own queries compiled for sqlite3 (registry/_fast_sql.py).
"""

from __future__ import annotations

from sqlalchemy import bindparam, text

from validation_service.registry.models import ValidationJob
from validation_service.registry.wakeups import CHANNEL

# ------------------------------------------------------------------ the queue
# The pools with a due job, on every scheduler tick, so it must not read the whole
# queue: a loose index scan visits one index entry per pool (a recursive MIN(pool) >
# previous), then looks for a due job within each of those pools. The recursive scan has
# no portable ORM form.
DUE_POOLS = text(
    """
    WITH RECURSIVE queued(pool) AS (
        SELECT (
            SELECT pool FROM validation_jobs WHERE status = :queued ORDER BY pool LIMIT 1
        )
        UNION ALL
        SELECT (
            SELECT pool FROM validation_jobs
            WHERE status = :queued AND pool > queued.pool ORDER BY pool LIMIT 1
        )
        FROM queued WHERE queued.pool IS NOT NULL
    )
    SELECT pool, (
        SELECT 1 FROM validation_jobs AS job
        WHERE job.status = :queued AND job.pool = queued.pool AND job.not_before <= :now
        LIMIT 1
    ) AS due
    FROM queued WHERE pool IS NOT NULL
    """
).bindparams(bindparam("now", type_=ValidationJob.__table__.c.not_before.type))

# PostgreSQL: a pool's claim lock, held to the end of the transaction (see
# queue.lock_pool). Advisory locks are PostgreSQL's own functions.
POOL_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:b_key, 0))")

# PostgreSQL: a replica's wake-ups (wakeups.py), on a connection of its own in autocommit.
LISTEN_FOR_JOBS = f"LISTEN {CHANNEL}"

# ------------------------------------------------------------- bulk imports
# The planner's statistics refreshed after a bulk import (outside any transaction).
ANALYZE = "ANALYZE"

# The metric values' columns in the order COPY writes them.
METRIC_VALUE_COLUMNS = ("checkpoint_id", "run_id", "name", "source", "value", "effective")
# PostgreSQL's COPY, several times faster than INSERT for a bulk import's metric values;
# it is a driver protocol of its own (psycopg's cursor.copy), not a statement to build.
COPY_METRIC_VALUES = f"COPY metric_values ({', '.join(METRIC_VALUE_COLUMNS)}) FROM STDIN"

# ------------------------------------------------------------------- SQLite
# What every SQLite connection of the registry is set to (see _engine.py): WAL so that
# readers never block the writer, a busy timeout, foreign keys enforced, and the commit
# durability WAL makes safe. PRAGMAs have no builder.
SQLITE_CONNECTION_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA busy_timeout=30000",
    "PRAGMA foreign_keys=ON",
    "PRAGMA synchronous=NORMAL",
)
# A write transaction takes the write lock up front; a read begins deferred.
SQLITE_BEGIN_WRITE = "BEGIN IMMEDIATE"
SQLITE_BEGIN_READ = "BEGIN"
# A migration that rebuilds tables turns foreign keys off meanwhile, then looks for the
# rows that break one.
SQLITE_FOREIGN_KEYS_OFF = "PRAGMA foreign_keys=OFF"
SQLITE_FOREIGN_KEYS_ON = "PRAGMA foreign_keys=ON"
SQLITE_FOREIGN_KEY_CHECK = "PRAGMA foreign_key_check"
