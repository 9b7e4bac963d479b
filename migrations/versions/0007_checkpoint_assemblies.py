"""checkpoint assemblies: one checkpoint written by several ranks, and each rank's part

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27

A sharded checkpoint (FSDP, DeepSpeed, torch.distributed.checkpoint) is written by every
rank: each rank's report() stores its own files as one part of the report's checkpoint.
The checkpoint row (and its validation job) is registered only once every rank that
reported in that step has stored its part; until then, and for ever when a rank died
first, the assembly row says where the parts are and what is missing.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoint_assemblies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("group_key", sa.String(length=128), nullable=False),
        sa.Column("report_index", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("deleted_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "group_key", name="uq_assemblies_run_group"),
    )
    op.create_index("ix_assemblies_run_status", "checkpoint_assemblies", ["run_id", "status"])
    op.create_table(
        "checkpoint_parts",
        sa.Column("assembly_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("files", sa.JSON(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("reported_metrics", sa.JSON(), nullable=False),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["assembly_id"], ["checkpoint_assemblies.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("assembly_id", "rank"),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_parts")
    op.drop_index("ix_assemblies_run_status", table_name="checkpoint_assemblies")
    op.drop_table("checkpoint_assemblies")
