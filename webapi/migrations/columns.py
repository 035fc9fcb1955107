"""The revisions that only add columns: their ``upgrade`` and ``downgrade`` from one list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op


def adding_columns(
    table: str, *columns: sa.Column[Any]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A revision's ``upgrade`` that adds ``columns`` to ``table`` and its ``downgrade`` that
    drops them again, last first (both in batch mode, so SQLite can too)."""

    def upgrade() -> None:
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.add_column(column)

    def downgrade() -> None:
        with op.batch_alter_table(table) as batch:
            for column in reversed(columns):
                batch.drop_column(column.name)

    return upgrade, downgrade
