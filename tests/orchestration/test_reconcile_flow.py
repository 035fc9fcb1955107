"""The reconcile flow runs one pass of the webapi relay against a migrated job store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from flows.reconcile import reconcile
from tests.orchestration.conftest import Home


@pytest.fixture
def job_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from webapi.config import get_settings
    from webapi.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'webapi.db'}"
    upgrade(url)
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FACEFLOW_DATABASE_URL", url)
    monkeypatch.setenv("FACEFLOW_PREFECT_API_URL", str(PREFECT_API_URL.value()))
    get_settings.cache_clear()
    yield url
    get_settings.cache_clear()


def test_reconcile_runs_every_relay_step(prefect_harness: Home, job_store: str) -> None:
    state = reconcile(return_state=True)
    assert state.is_completed(), state.message
    counts = state.result()
    assert set(counts) == {"fetch", "dispatch", "sync", "expire", "reap", "notify"}
    assert all(n == 0 for n in counts.values())
