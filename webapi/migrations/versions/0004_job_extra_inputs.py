"""jobs.extra_inputs: storage keys of a per-face mapping's other sources and references.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 15:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("extra_inputs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("extra_inputs")
