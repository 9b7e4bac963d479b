"""early stopping: stop policies by run name, stop decisions by run attempt

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26

stop_policies holds one StopPolicy per (namespace, run name): it may be stored before the
run's first report and applies to every attempt of the name. stop_decisions holds what
the service decided for a run attempt, one row per round: unique (run_id, round) keeps
the first decision of a round however many validations finish at once; an override
closes the round.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stop_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("run_name", sa.String(length=255), nullable=False),
        sa.Column("metric", sa.String(length=255), nullable=False),
        sa.Column("mode", sa.String(length=8), nullable=False),
        sa.Column("patience", sa.Integer(), nullable=True),
        sa.Column("min_delta", sa.Float(), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("divergence", sa.Float(), nullable=True),
        sa.Column("median_of_runs", sa.Boolean(), nullable=False),
        sa.Column("warmup", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("namespace", "run_name", name="uq_stop_policies_run"),
    )
    op.create_table(
        "stop_decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("rule", sa.String(length=32), nullable=False),
        sa.Column("report_index", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("metric_values", sa.JSON(), nullable=False),
        sa.Column("reference", sa.Float(), nullable=True),
        sa.Column("skipped", sa.JSON(), nullable=False),
        sa.Column("decided_at", sa.DateTime(), nullable=False),
        sa.Column("overridden_at", sa.DateTime(), nullable=True),
        sa.Column("resumed_after_index", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "round", name="uq_stop_decisions_run_round"),
    )


def downgrade() -> None:
    op.drop_table("stop_decisions")
    op.drop_table("stop_policies")
