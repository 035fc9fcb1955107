"""jobs.quality: the result's quality report (identity, pose, faces found, fuser settings).

Create Date: 2026-12-03 14:40:00
"""

from __future__ import annotations

import sqlalchemy as sa

from webapi.migrations.columns import adding_columns

revision = "0003"
down_revision = "0002"
upgrade, downgrade = adding_columns("jobs", sa.Column("quality", sa.JSON(), nullable=True))
