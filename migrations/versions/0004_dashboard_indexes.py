"""dashboard and /metrics indexes

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

validation_jobs (run_id, updated_at): a run's last job change is one index seek, so the
runs list sorts 1k runs by last activity without reading their jobs. validation_jobs
(updated_at): a /metrics scrape reads only the jobs that changed since the last one.
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.create_index("ix_validation_jobs_run_updated", ["run_id", "updated_at"])
        batch_op.create_index("ix_validation_jobs_updated", ["updated_at"])


def downgrade() -> None:
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_validation_jobs_updated")
        batch_op.drop_index("ix_validation_jobs_run_updated")
