"""The in-process API-key cache: what it saves, and how soon a revoked key stops working.

``settings.auth_cache_seconds`` bounds how long a disabled user or a revoked key is still
accepted by one API process; 0 turns the cache off (every request reads the key table).
"""

from __future__ import annotations

import time
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import auth, make_user
from tests.webapi.conftest import make_settings
from webapi.auth import KeyCache
from webapi.main import create_app
from webapi.models import ApiKey, User, utcnow


def test_key_cache_expires_bounds_and_can_be_off() -> None:
    cache: KeyCache[str] = KeyCache(ttl_s=0.2, max_entries=2)
    cache.put("a", "alice")
    assert cache.get("a") == "alice" and cache.get("missing") is None
    cache.put("b", "bob")
    cache.get("a")  # a is now the most recently used
    cache.put("c", "carol")  # evicts b, the least recently used
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("alice", None, "carol")
    time.sleep(0.25)
    assert cache.get("a") is None and cache.get("c") is None
    off: KeyCache[str] = KeyCache(ttl_s=0)
    off.put("a", "alice")
    assert off.get("a") is None
    cache.put("a", "alice")
    cache.clear()
    assert cache.get("a") is None


def _disable(engine: Engine, user_id: object) -> None:
    with Session(engine) as session:
        session.execute(sa.update(User).where(User.id == user_id).values(disabled=True))  # type: ignore[arg-type]
        session.commit()


def _revoke_keys(engine: Engine, user_id: object) -> None:
    with Session(engine) as session:
        session.execute(
            sa.update(ApiKey).where(ApiKey.user_id == user_id).values(revoked_at=utcnow())  # type: ignore[arg-type]
        )
        session.commit()


def test_without_the_cache_a_disabled_user_is_refused_at_once(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    settings = make_settings(database_url, tmp_path, auth_cache_seconds=0)
    with TestClient(create_app(settings)) as client:
        user = make_user(engine, settings)
        assert client.get("/v1/jobs", headers=auth(user)).status_code == 200
        _disable(engine, user.user.id)
        assert client.get("/v1/jobs", headers=auth(user)).status_code == 401


def test_a_revoked_key_stops_working_within_the_cache_time(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    ttl = 0.5
    settings = make_settings(database_url, tmp_path, auth_cache_seconds=ttl)
    with TestClient(create_app(settings)) as client:
        user = make_user(engine, settings)
        other = make_user(engine, settings)
        assert client.get("/v1/jobs", headers=auth(user)).status_code == 200
        revoked_at = time.monotonic()
        _revoke_keys(engine, user.user.id)
        # remembered for at most ``ttl``: the key table is not read again before then
        if time.monotonic() - revoked_at < ttl * 0.8:
            assert client.get("/v1/jobs", headers=auth(user)).status_code == 200
        time.sleep(ttl + 0.05)
        assert client.get("/v1/jobs", headers=auth(user)).status_code == 401
        # a key never seen before is looked up at once, and unknown keys are never cached
        assert client.get("/v1/jobs", headers=auth(other)).status_code == 200
        bad = {"Authorization": "Bearer ff_" + "x" * 43}
        assert client.get("/v1/jobs", headers=bad).status_code == 401
