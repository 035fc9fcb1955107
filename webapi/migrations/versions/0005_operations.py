"""Operations: per-user priority class and retention, per-job retention and purge times.

Jobs that had already ended get purge times from the defaults (inputs at their end,
results 24 h after it), so the first retention pass treats them like new ones.

Create Date: 2026-12-03 15:10:00.000000
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"

DEFAULT_RESULT_RETENTION_S = 86400
BACKFILL_BATCH = 1000
JOB_INDEXES = {
    "ix_jobs_status_priority": ["status", "priority"],
    "ix_jobs_inputs_purge_at": ["inputs_purge_at"],
    "ix_jobs_result_purge_at": ["result_purge_at"],
    "ix_jobs_finished_at": ["finished_at"],
    "ix_jobs_source_key": ["source_key"],
    "ix_jobs_target_key": ["target_key"],
}


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("priority", sa.String(length=10), nullable=False, server_default="normal")
        )
        batch_op.add_column(sa.Column("input_retention_s", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("result_retention_s", sa.Integer(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("input_retention_s", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column(
                "result_retention_s",
                sa.Integer(),
                nullable=False,
                server_default=str(DEFAULT_RESULT_RETENTION_S),
            )
        )
        for name in ("inputs_purge_at", "result_purge_at", "inputs_purged_at", "result_expired_at"):
            batch_op.add_column(sa.Column(name, sa.DateTime(), nullable=True))
        for name, columns in JOB_INDEXES.items():
            batch_op.create_index(name, columns, unique=False)
    _backfill_ended_jobs()


def _backfill_ended_jobs() -> None:
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.Uuid()),
        sa.column("finished_at", sa.DateTime()),
        sa.column("inputs_purge_at", sa.DateTime()),
        sa.column("result_purge_at", sa.DateTime()),
    )
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(jobs.c.id, jobs.c.finished_at).where(jobs.c.finished_at.is_not(None))
    ).all()
    for start in range(0, len(rows), BACKFILL_BATCH):
        for job_id, finished_at in rows[start : start + BACKFILL_BATCH]:
            connection.execute(
                sa.update(jobs)
                .where(jobs.c.id == job_id)
                .values(
                    inputs_purge_at=finished_at,
                    result_purge_at=finished_at + timedelta(seconds=DEFAULT_RESULT_RETENTION_S),
                )
            )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for name in JOB_INDEXES:
            batch_op.drop_index(name)
        for name in (
            "result_expired_at",
            "inputs_purged_at",
            "result_purge_at",
            "inputs_purge_at",
            "result_retention_s",
            "input_retention_s",
        ):
            batch_op.drop_column(name)
    with op.batch_alter_table("users", schema=None) as batch_op:
        for name in ("result_retention_s", "input_retention_s", "priority"):
            batch_op.drop_column(name)
