"""Names of the statements in registry/_fast_sql.py that come in variants, for the
generator (_fast_sql_source.py) and the CLI's fast read (_fast_read.py) alike. Plain
Python: the fast read imports this without SQLAlchemy."""

from __future__ import annotations


def jobs_statement(of_run: bool, in_statuses: bool, in_pool: bool, newest: bool) -> str:
    """The name of queue.list_jobs_query compiled with these filters given."""
    parts = [
        "JOBS",
        *(["OF_RUN"] if of_run else []),
        *(["IN_STATUSES"] if in_statuses else []),
        *(["IN_POOL"] if in_pool else []),
        *(["NEWEST"] if newest else []),
    ]
    return "_".join(parts)
