"""jobs.input_pixels: the pixels a job's images decode to together (the batch planner's
measure). Existing rows keep NULL, which the planner counts as the per-job budget.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("input_pixels", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("input_pixels")
