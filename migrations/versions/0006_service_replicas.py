"""service replicas: one row per replica of a service, kept fresh by its heartbeats

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26

Several replicas of one service claim from one PostgreSQL registry. Each writes its row at
start and at every heartbeat: `ckval status`, the API and /metrics read who serves the
queue, on which node and process, and how fresh its last heartbeat is, without Ray.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "service_replicas",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("service_name", sa.String(length=255), nullable=False),
        sa.Column("owner", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("node_id", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_service_replicas_service", "service_replicas", ["service_name"])


def downgrade() -> None:
    op.drop_index("ix_service_replicas_service", table_name="service_replicas")
    op.drop_table("service_replicas")
