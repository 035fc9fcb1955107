"""Video jobs: jobs.media ('photo' | 'video'), the video target's probe (video_input), the
result's report (video_report) and a running video job's progress. Existing rows are
photos.

Create Date: 2026-12-04 22:30:00
"""

from __future__ import annotations

import sqlalchemy as sa

from webapi.migrations.columns import adding_columns

revision = "0007"
down_revision = "0006"
upgrade, downgrade = adding_columns(
    "jobs",
    sa.Column("media", sa.String(8), nullable=False, server_default="photo"),
    sa.Column("video_input", sa.JSON(), nullable=True),
    sa.Column("video_report", sa.JSON(), nullable=True),
    sa.Column("progress", sa.JSON(), nullable=True),
)
