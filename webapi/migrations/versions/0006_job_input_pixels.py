"""jobs.input_pixels: the pixels a job's images decode to together (the batch planner's
measure). Existing rows keep NULL, which the planner counts as the per-job budget.

Create Date: 2026-12-04 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa

from webapi.migrations.columns import adding_columns

revision = "0006"
down_revision = "0005"
upgrade, downgrade = adding_columns(
    "jobs", sa.Column("input_pixels", sa.BigInteger(), nullable=True)
)
