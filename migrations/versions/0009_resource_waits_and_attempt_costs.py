"""resource waits and what each attempt held: jobs waiting for nodes, accelerator-seconds

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28

A claimed job whose Ray task waits for resources (a node the autoscaler is adding) is
WAITING_FOR_RESOURCES, with since when and what for; its status column grows to hold the
name (PostgreSQL only: SQLite keeps any length in a VARCHAR). Each attempt records the
accelerator type and count it held and how long it ran, so that a run's validations can
be told in accelerator-seconds.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "validation_jobs",
            "status",
            type_=sa.String(length=32),
            existing_type=sa.String(length=16),
            existing_nullable=False,
        )
    op.add_column("validation_jobs", sa.Column("waiting_since", sa.DateTime(), nullable=True))
    op.add_column("validation_jobs", sa.Column("waiting_for", sa.JSON(), nullable=True))
    op.add_column(
        "validation_attempts", sa.Column("accelerator_type", sa.String(length=64), nullable=True)
    )
    op.add_column("validation_attempts", sa.Column("accelerators", sa.Float(), nullable=True))
    op.add_column("validation_attempts", sa.Column("running_s", sa.Float(), nullable=True))


def downgrade() -> None:
    # A job waiting for resources goes back to RUNNING, the status that revision knew.
    op.execute(
        "UPDATE validation_jobs SET status = 'RUNNING' WHERE status = 'WAITING_FOR_RESOURCES'"
    )
    with op.batch_alter_table("validation_attempts") as batch:
        batch.drop_column("running_s")
        batch.drop_column("accelerators")
        batch.drop_column("accelerator_type")
    with op.batch_alter_table("validation_jobs") as batch:
        batch.drop_column("waiting_for")
        batch.drop_column("waiting_since")
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "validation_jobs",
            "status",
            type_=sa.String(length=16),
            existing_type=sa.String(length=32),
            existing_nullable=False,
        )
