"""watched folders: folders the service lists for new step folders of a run

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

Trainers that are not Ray Train save step folders (step-100, checkpoint-200) to a disk or
a bucket. A watch names such a folder, the run its step folders join and the validation
each one gets; the service claims a watch for each listing as it claims a job (a lease
and a fencing token), and registers each new step folder once: watched_folders keeps
every step folder a watch has seen, keyed by (watch, name).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "watches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("run_name", sa.String(length=255), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("validator", sa.String(length=128), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("validate_fn_pickle", sa.LargeBinary(), nullable=True),
        sa.Column("validate_config", sa.LargeBinary(), nullable=True),
        sa.Column("ready", sa.String(length=300), nullable=False),
        sa.Column("pattern", sa.String(length=255), nullable=True),
        sa.Column("copy", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("removed_at", sa.DateTime(), nullable=True),
        sa.Column("next_listing_at", sa.DateTime(), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("last_listed_at", sa.DateTime(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "uq_watches_live_folder",
        "watches",
        ["namespace", "run_name", "uri"],
        unique=True,
        sqlite_where=sa.text("removed_at IS NULL"),
        postgresql_where=sa.text("removed_at IS NULL"),
    )
    op.create_index("ix_watches_due", "watches", ["removed_at", "next_listing_at"])
    op.create_table(
        "watched_folders",
        sa.Column("watch_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("first_seen_at", sa.DateTime(), nullable=False),
        sa.Column("changed_at", sa.DateTime(), nullable=False),
        sa.Column("report_index", sa.Integer(), nullable=True),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("registered_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["watch_id"], ["watches.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("watch_id", "name"),
    )


def downgrade() -> None:
    op.drop_table("watched_folders")
    op.drop_index("ix_watches_due", table_name="watches")
    op.drop_index("uq_watches_live_folder", table_name="watches")
    op.drop_table("watches")
