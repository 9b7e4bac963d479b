"""validators: every job belongs to a named evaluation; outside checkpoints; job warnings

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27

A checkpoint can be validated by several evaluations over its life: the one its report()
asked for ("default", every existing job) and later ones queued by revalidate() under a
name of their own. The metrics of a named evaluation live in evaluation_metrics, one row
per (checkpoint, validator, metric), so a second evaluation never overwrites the first.
Jobs queued over history are "background": the queue hands them out after the live
runs' jobs. A checkpoint added by register() is "external": retention never deletes it.
A job keeps the warnings its attempt gave (a sink that logged elsewhere, for example),
an attempt the output its validator kept (an outside program's stdout and stderr).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "validation_jobs",
        sa.Column("validator", sa.String(length=128), nullable=False, server_default="default"),
    )
    op.add_column(
        "validation_jobs",
        sa.Column("background", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column("validation_jobs", sa.Column("warnings", sa.JSON(), nullable=True))
    op.add_column("validation_attempts", sa.Column("log", sa.Text(), nullable=True))
    op.add_column(
        "checkpoints",
        sa.Column("external", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    # Live runs' jobs first: the claim orders by (background, priority desc, id).
    op.drop_index("ix_validation_jobs_due", table_name="validation_jobs")
    op.create_index(
        "ix_validation_jobs_due",
        "validation_jobs",
        ["status", "pool", "background", "priority", "not_before"],
    )
    op.create_index(
        "ix_validation_jobs_checkpoint_validator",
        "validation_jobs",
        ["checkpoint_id", "validator"],
    )
    op.create_table(
        "evaluation_metrics",
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("validator", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("checkpoint_id", "validator", "name"),
    )
    op.create_index(
        "ix_evaluation_metrics_run_rank",
        "evaluation_metrics",
        ["run_id", "validator", "name", "value"],
    )
    op.create_index(
        "ix_evaluation_metrics_rank", "evaluation_metrics", ["validator", "name", "value"]
    )


def downgrade() -> None:
    op.drop_index("ix_evaluation_metrics_rank", table_name="evaluation_metrics")
    op.drop_index("ix_evaluation_metrics_run_rank", table_name="evaluation_metrics")
    op.drop_table("evaluation_metrics")
    op.drop_index("ix_validation_jobs_checkpoint_validator", table_name="validation_jobs")
    op.drop_index("ix_validation_jobs_due", table_name="validation_jobs")
    op.create_index(
        "ix_validation_jobs_due", "validation_jobs", ["status", "pool", "priority", "not_before"]
    )
    with op.batch_alter_table("validation_attempts") as batch:
        batch.drop_column("log")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("external")
    with op.batch_alter_table("validation_jobs") as batch:
        batch.drop_column("warnings")
        batch.drop_column("background")
        batch.drop_column("validator")
