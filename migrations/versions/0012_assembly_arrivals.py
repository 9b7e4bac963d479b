"""report progress: every rank of a worker group says how far it reported

Revision ID: 0012
Revises: 0010
Create Date: 2026-11-28

A checkpoint written by several ranks is sealed once every rank of its worker group has
reported past it (report_progress, one row per rank, moved on at each report() call,
with or without a checkpoint) and every rank that joined it with a part has stored that
part, or failed to (checkpoint_parts.status: 'stored' or 'failed', with the reason in
detail). An assembly knows how many ranks its worker group has (world_size); rows
written before have world_size NULL and their parts 'stored'.

registry_identity holds one id, made here: ranks on several nodes compare the ids of the
registries they report into, and refuse to split a checkpoint across two.
"""

from __future__ import annotations

import datetime as dt
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoint_assemblies", sa.Column("world_size", sa.Integer(), nullable=True))
    with op.batch_alter_table("checkpoint_parts") as batch:
        batch.add_column(
            sa.Column("status", sa.String(length=16), nullable=False, server_default="stored")
        )
        batch.add_column(sa.Column("detail", sa.Text(), nullable=True))
        batch.alter_column("location", existing_type=sa.Text(), nullable=True)
    op.create_table(
        "report_progress",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("worker_group", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("last_call", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "worker_group", "rank"),
    )
    identity = op.create_table(
        "registry_identity",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    op.bulk_insert(identity, [{"id": str(uuid.uuid4()), "created_at": now}])


def downgrade() -> None:
    op.drop_table("registry_identity")
    op.drop_table("report_progress")
    with op.batch_alter_table("checkpoint_parts") as batch:
        batch.alter_column("location", existing_type=sa.Text(), nullable=False)
        batch.drop_column("detail")
        batch.drop_column("status")
    op.drop_column("checkpoint_assemblies", "world_size")
