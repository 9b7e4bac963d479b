"""report index reservation: runs.next_report_index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Every process that reports to a run reserves its report indices from this counter, so
that two processes never share an index (nor the storage folder named after it). An
existing database keeps its rows; each run's counter starts after its highest index.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ALTER TABLE, never a batch copy of runs: on SQLite the copy drops the old
    # table, and its ON DELETE CASCADE would take every checkpoint with it.
    op.add_column(
        "runs", sa.Column("next_report_index", sa.Integer(), nullable=False, server_default="0")
    )
    runs = sa.table("runs", sa.column("id", sa.Integer), sa.column("next_report_index"))
    checkpoints = sa.table(
        "checkpoints", sa.column("run_id", sa.Integer), sa.column("report_index", sa.Integer)
    )
    highest = (
        sa.select(sa.func.max(checkpoints.c.report_index) + 1)
        .where(checkpoints.c.run_id == runs.c.id)
        .scalar_subquery()
    )
    op.execute(runs.update().values(next_report_index=sa.func.coalesce(highest, 0)))


def downgrade() -> None:
    op.drop_column("runs", "next_report_index")  # SQLite >= 3.35 drops a column in place
