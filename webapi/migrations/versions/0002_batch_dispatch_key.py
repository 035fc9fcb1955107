"""Micro-batched dispatch: jobs.dispatch_key (the batch run planned for an attempt).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("dispatch_key", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("dispatch_key")
