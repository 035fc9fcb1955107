"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from tests.videos import Videos


@pytest.fixture(scope="session")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Videos:
    """The test videos of ``tests/videos.py``, each written once per session on first use."""
    return Videos(tmp_path_factory.mktemp("videos"))
