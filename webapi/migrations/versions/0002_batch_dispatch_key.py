"""Micro-batched dispatch: jobs.dispatch_key (the batch run planned for an attempt).

Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa

from webapi.migrations.columns import adding_columns

revision = "0002"
down_revision = "0001"
upgrade, downgrade = adding_columns(
    "jobs", sa.Column("dispatch_key", sa.String(length=64), nullable=True)
)
