"""Fixtures shared by every test package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.videos import Videos


@pytest.fixture(scope="session")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Videos:
    """The test videos of ``tests/videos.py``, each written once per session on first use."""
    from tests.videos import Videos  # PyAV only for the suites that use it

    return Videos(tmp_path_factory.mktemp("videos"))
