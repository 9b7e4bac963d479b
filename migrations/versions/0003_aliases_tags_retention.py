"""aliases, tags, retention policies, run attempts and run end

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A run name reused after the run ended starts a new attempt: a runs row of its own, so
the unique key of runs becomes (namespace, name, attempt). On SQLite that rebuilds the
runs table, which the migration runner does with foreign keys off (see _migrate.py):
dropping the old table would otherwise cascade to every checkpoint.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("attempt", sa.Integer(), nullable=False, server_default=sa.text("1"))
        )
        batch_op.add_column(sa.Column("ended_at", sa.DateTime(), nullable=True))
        batch_op.drop_constraint("uq_runs_namespace_name", type_="unique")
        batch_op.create_unique_constraint(
            "uq_runs_namespace_name_attempt", ["namespace", "name", "attempt"]
        )

    op.create_table(
        "checkpoint_aliases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=255), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "alias", name="uq_checkpoint_aliases_run_alias"),
    )
    with op.batch_alter_table("checkpoint_aliases", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_checkpoint_aliases_checkpoint_id"), ["checkpoint_id"], unique=False
        )

    op.create_table(
        "tracked_aliases",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=255), nullable=False),
        sa.Column("metric", sa.String(length=255), nullable=False),
        sa.Column("mode", sa.String(length=8), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "alias"),
    )

    op.create_table(
        "checkpoint_tags",
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("value", sa.String(length=1000), nullable=False),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("checkpoint_id", "key"),
    )
    with op.batch_alter_table("checkpoint_tags", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_tags_key_value", ["key", "value"], unique=False)

    op.create_table(
        "retention_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("run_name", sa.String(length=255), nullable=False),
        sa.Column("metric", sa.String(length=255), nullable=False),
        sa.Column("mode", sa.String(length=8), nullable=False),
        sa.Column("keep_best", sa.Integer(), nullable=False),
        sa.Column("keep_best_per_run", sa.Integer(), nullable=False),
        sa.Column("keep_latest", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("namespace", "run_name", name="uq_retention_policies_scope"),
    )


def downgrade() -> None:
    op.drop_table("retention_policies")
    with op.batch_alter_table("checkpoint_tags", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_tags_key_value")
    op.drop_table("checkpoint_tags")
    op.drop_table("tracked_aliases")
    with op.batch_alter_table("checkpoint_aliases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_aliases_checkpoint_id"))
    op.drop_table("checkpoint_aliases")
    # Later attempts of a run cannot keep its name under the old unique key: each keeps
    # its checkpoints under the name "<run> (attempt N)".
    runs = sa.table("runs", sa.column("name", sa.String()), sa.column("attempt", sa.Integer()))
    op.execute(
        runs.update()
        .where(runs.c.attempt > 1)
        .values(name=runs.c.name + " (attempt " + sa.cast(runs.c.attempt, sa.String) + ")")
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_runs_namespace_name_attempt", type_="unique")
        batch_op.create_unique_constraint("uq_runs_namespace_name", ["namespace", "name"])
        batch_op.drop_column("ended_at")
        batch_op.drop_column("attempt")
