"""jobs.extra_inputs: storage keys of a per-face mapping's other sources and references.

Create Date: 2026-12-03 15:40:00
"""

from __future__ import annotations

import sqlalchemy as sa

from webapi.migrations.columns import adding_columns

revision = "0004"
down_revision = "0003"
upgrade, downgrade = adding_columns("jobs", sa.Column("extra_inputs", sa.JSON(), nullable=True))
