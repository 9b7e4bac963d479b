"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("storage_root", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("namespace", "name", name="uq_runs_namespace_name"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("report_index", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("manifest_sha256", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("reported_metrics", sa.JSON(), nullable=False),
        sa.Column("validated_metrics", sa.JSON(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("validation_status", sa.String(length=16), nullable=False),
        sa.Column("deleted_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "report_index", name="uq_checkpoints_run_report_index"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoints_run_id"), ["run_id"], unique=False)

    op.create_table(
        "metric_values",
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("effective", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("checkpoint_id", "name", "source"),
    )
    with op.batch_alter_table("metric_values", schema=None) as batch_op:
        batch_op.create_index("ix_metric_values_rank", ["name", "effective", "value"], unique=False)
        batch_op.create_index(
            "ix_metric_values_run_rank", ["run_id", "name", "effective", "value"], unique=False
        )

    op.create_table(
        "validation_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=512), nullable=False),
        sa.Column("validate_fn_ref", sa.Text(), nullable=True),
        sa.Column("validate_fn_pickle", sa.LargeBinary(), nullable=True),
        sa.Column("validate_fn_name", sa.String(length=512), nullable=False),
        sa.Column("validate_config", sa.LargeBinary(), nullable=True),
        sa.Column("executor_kind", sa.String(length=32), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("attempts_before_retry", sa.Integer(), nullable=False),
        sa.Column("not_before", sa.DateTime(), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("timeout_s", sa.Float(), nullable=True),
        sa.Column("retry_on_timeout", sa.Boolean(), nullable=False),
        sa.Column("error_type", sa.String(length=255), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("error_traceback", sa.Text(), nullable=True),
        sa.Column("result_metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key"),
    )
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_validation_jobs_checkpoint_id"), ["checkpoint_id"], unique=False
        )
        batch_op.create_index(
            "ix_validation_jobs_due", ["status", "pool", "priority", "not_before"], unique=False
        )
        batch_op.create_index(
            "ix_validation_jobs_lease", ["status", "lease_expires_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_validation_jobs_run_id"), ["run_id"], unique=False)

    op.create_table(
        "validation_attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("lease_token", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("claimed_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("node_id", sa.String(length=128), nullable=True),
        sa.Column("worker_pid", sa.Integer(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["validation_jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "attempt", name="uq_validation_attempts_job"),
    )
    with op.batch_alter_table("validation_attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_validation_attempts_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("validation_attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_validation_attempts_job_id"))

    op.drop_table("validation_attempts")
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_validation_jobs_run_id"))
        batch_op.drop_index("ix_validation_jobs_lease")
        batch_op.drop_index("ix_validation_jobs_due")
        batch_op.drop_index(batch_op.f("ix_validation_jobs_checkpoint_id"))

    op.drop_table("validation_jobs")
    with op.batch_alter_table("metric_values", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_values_run_rank")
        batch_op.drop_index("ix_metric_values_rank")

    op.drop_table("metric_values")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_run_id"))

    op.drop_table("checkpoints")
    op.drop_table("runs")
