"""Limits the Registry's queries and the CLI's fast read path (registry/_fast_read.py)
share, named once so that both read the same rows. Plain constants: the fast read path
imports this without SQLAlchemy."""

from __future__ import annotations

# Run names a RunNotFound suggests (the first ones the database returns).
KNOWN_RUN_NAMES = 50
# Checkpoints read for the metric names an UnknownMetric lists.
KNOWN_METRICS_ROWS = 10_000
# Ids per IN (...) list: far below SQLite's and PostgreSQL's limits on bound parameters.
IDS_PER_IN_LIST = 5000
