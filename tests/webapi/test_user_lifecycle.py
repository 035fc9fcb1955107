"""Key and user lifecycle through the ``faceflow`` CLI against a running API.

``faceflow users disable|enable`` and ``faceflow keys list|revoke|rotate`` run through
typer's CliRunner on the same job store (SQLite and PostgreSQL) that a real app serves
(TestClient); the bounds checked are the auth cache's (``auth_cache_seconds``) and a
rotation's grace period.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner, Result

from faceflow.cli import app as faceflow_app
from faceflow.testing.jobs import (
    auth,
    dispatch,
    job_body,
    jobs_of,
    make_user,
    move,
    submit,
    succeed,
)
from faceflow.testing.wait import poll
from tests.webapi.conftest import app_client
from webapi import crud
from webapi.auth import KeyCache
from webapi.config import Settings, get_settings
from webapi.main import create_app
from webapi.models import ApiKey, JobStatus, Outbox


class Clock:
    """The app's auth-cache clock: stopped, or (``running``) the real monotonic clock; in
    both cases plus what the test skipped."""

    def __init__(self, running: bool) -> None:
        self.running, self.skipped, self.start = running, 0.0, time.monotonic()

    def __call__(self) -> float:
        return (time.monotonic() if self.running else self.start) + self.skipped

    def skip(self, seconds: float) -> None:
        self.skipped += seconds


def cache_clock(client: TestClient, running: bool = False) -> Clock:
    """Put a ``Clock`` under the app's key cache (before anything is cached)."""
    clock = Clock(running)
    client.app.state.users.clock = clock  # type: ignore[attr-defined]
    return clock


@contextmanager
def cached_app(
    database_url: str, tmp_path: Path, ttl: float, *, running: bool = False
) -> Iterator[tuple[TestClient, Clock, Settings]]:
    """A running app whose auth cache keeps keys ``ttl`` seconds on a ``Clock`` the test
    controls (``cache_clock``), with the app's settings."""
    with app_client(database_url, tmp_path, auth_cache_seconds=ttl) as client:
        clock = cache_clock(client, running=running)
        yield client, clock, client.app.state.settings  # type: ignore[attr-defined]


@pytest.fixture
def cli(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Result]]:
    """``faceflow ARGS... --database-url URL`` in-process; settings from a clean env."""
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FACEFLOW_AUTH_CACHE_SECONDS", "1")
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args: str, ok: bool = True) -> Result:
        result = runner.invoke(faceflow_app, [*args, "--database-url", database_url])
        if ok:
            assert result.exit_code == 0, result.output
        return result

    yield run
    get_settings.cache_clear()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def refused_after(client: TestClient, headers: dict[str, str], since: float) -> float:
    """Poll ``GET /v1/jobs`` until it is 401; seconds from ``since``."""
    left_s = 30 - (time.monotonic() - since)
    refused = poll(
        lambda: client.get("/v1/jobs", headers=headers).status_code != 200, left_s, step_s=0.02
    )
    assert refused, "still accepted after 30 s"
    return time.monotonic() - since


def cached_until_its_ttl(
    client: TestClient, headers: dict[str, str], clock: Clock, ttl: float
) -> None:
    """A key the store refuses now is still answered from the cache just before its entry's
    ``ttl`` ends and refused at its end (a stopped cache clock skipped ahead: no waiting)."""
    clock.skip(ttl - 0.05)
    assert client.get("/v1/jobs", headers=headers).status_code == 200
    clock.skip(0.05)
    assert client.get("/v1/jobs", headers=headers).status_code == 401


def key_ids(output: str) -> list[str]:
    return re.findall(r"^([0-9a-f-]{36})\t", output, flags=re.MULTILINE)


# --------------------------------------------------------------------------- users


def test_disable_cancels_jobs_refuses_submits_at_once_and_keys_within_the_cache_time(
    database_url: str, tmp_path: Path, engine: Engine, cli: Callable[..., Result]
) -> None:
    ttl = 5.0
    with cached_app(database_url, tmp_path, ttl) as (client, clock, settings):
        alice = make_user(engine, settings, name="alice")
        bob = make_user(engine, settings, name="bob")
        queued = [submit(client, alice) for _ in range(2)]
        sent = submit(client, alice)  # dispatched: a flow run exists, not started yet
        run_of_sent = dispatch(engine, sent)
        running = submit(client, alice)
        dispatch(engine, running)
        move(engine, running, JobStatus.running, JobStatus.queued)
        done = submit(client, alice)
        succeed(engine, done, result_key=f"results/{done}/attempt-1.png")
        bobs = submit(client, bob)
        assert client.get("/v1/jobs", headers=auth(alice)).status_code == 200  # now cached

        result = cli("users", "disable", "alice")
        assert "3 queued jobs cancelled, 1 running jobs asked to stop" in result.output
        # the key is still cached, but a submit reads the flag under the user-row lock
        assert client.get("/v1/jobs", headers=auth(alice)).status_code == 200
        response = client.post("/v1/jobs", json=job_body(), headers=auth(alice))
        assert response.status_code == 401, response.text
        cached_until_its_ttl(client, auth(alice), clock, ttl)  # other requests
        assert client.get("/v1/jobs", headers=auth(bob)).status_code == 200

        states = {str(job.id): job for job in jobs_of(engine)}
        for job_id in (*queued, sent):
            assert states[job_id].status is JobStatus.cancelled
            assert states[job_id].error_message == crud.USER_DISABLED_MESSAGE
        assert states[running].status is JobStatus.cancel_requested
        assert states[done].status is JobStatus.succeeded
        assert states[bobs].status is JobStatus.queued
        with Session(engine) as session:  # the relay cancels the flow runs that exist
            cancels = session.exec(select(Outbox).where(col(Outbox.kind) == "cancel_run")).all()
        assert sorted(row.payload["flow_run_id"] for row in cancels) == sorted(
            str(run) for run in (run_of_sent, states[running].flow_run_id)
        )
        users = cli("users", "list").output.splitlines()
        assert [line.endswith("(disabled)") for line in users] == [True, False]  # alice, bob

        assert "user alice enabled" in cli("users", "enable", "alice").output
        assert client.get("/v1/jobs", headers=auth(alice)).status_code == 200  # at once
        submit(client, alice)
        assert {job.status for job in jobs_of(engine, alice.user.id)} >= {
            JobStatus.cancelled,
            JobStatus.queued,
        }


def test_unknown_names_and_ids_exit_1(cli: Callable[..., Result]) -> None:
    for args in (
        ("users", "disable", "nobody"),
        ("users", "enable", "nobody"),
        ("keys", "list", "nobody"),
        ("keys", "rotate", "nobody"),
        ("keys", "revoke", str(uuid.uuid4())),
    ):
        result = cli(*args, ok=False)
        assert result.exit_code == 1 and "error:" in result.output, args
    assert cli("keys", "revoke", "not-a-uuid", ok=False).exit_code == 2


# --------------------------------------------------------------------------- keys


def test_keys_are_listed_by_id_and_a_revoked_key_stops_within_the_cache_time(
    database_url: str, tmp_path: Path, engine: Engine, cli: Callable[..., Result]
) -> None:
    ttl = 1.0
    with cached_app(database_url, tmp_path, ttl) as (client, clock, settings):
        carol = make_user(engine, settings, name="carol")
        listed = cli("keys", "list", "carol").output
        assert key_ids(listed) == [str(carol.key_id)] and "\tactive" in listed
        assert carol.api_key not in listed and carol.api_key[:10] in listed  # a prefix only
        new_key = _printed_key(cli("keys", "rotate", "carol", "--grace", "3600").output)
        assert client.get("/v1/jobs", headers=auth(carol)).status_code == 200  # cached

        result = cli("keys", "revoke", str(carol.key_id))
        assert "revoked" in result.output and carol.api_key not in result.output
        cached_until_its_ttl(client, auth(carol), clock, ttl)
        assert client.get("/v1/jobs", headers=bearer(new_key)).status_code == 200

        listed = cli("keys", "list", "carol").output
        assert listed.count("\tactive") == 1 and "\trevoked " in listed
        again = cli("keys", "revoke", str(carol.key_id)).output  # keeps its time
        assert again.split("revoked ")[1][:19] == result.output.split("revoked ")[1][:19]


def _printed_key(output: str) -> str:
    [key] = re.findall(r"^api key:\s+(ff_\S+)$", output, flags=re.MULTILINE)
    return key


def test_rotate_keeps_the_old_key_for_the_grace_period_only(
    database_url: str, tmp_path: Path, engine: Engine, cli: Callable[..., Result]
) -> None:
    """The old key stops at the end of the grace, not up to a cache time later: a key
    looked up during its grace is cached only until its end (an entry cached before
    the rotation lasts its ``ttl``; the grace is normally far longer)."""
    ttl, grace = 10.0, 3.0  # an entry cached in the grace would outlive it by far
    with cached_app(database_url, tmp_path, ttl, running=True) as (client, clock, settings):
        dave = make_user(engine, settings, name="dave")
        assert client.get("/v1/jobs", headers=auth(dave)).status_code == 200  # cached

        result = cli("keys", "rotate", "dave", "--grace", str(grace))
        rotated_at = time.monotonic()
        new_key = _printed_key(result.output)
        assert result.output.count(new_key) == 1 and dave.api_key not in result.output
        assert f"old key: {dave.key_id} valid until " in result.output
        assert client.get("/v1/jobs", headers=bearer(new_key)).status_code == 200
        submit(client, dave)  # the old key still submits during the grace
        clock.skip(ttl)  # the entry cached before the rotation has ended: looked up again,
        assert client.get("/v1/jobs", headers=auth(dave)).status_code == 200  # kept to its end
        uncached = settings.model_copy(update={"auth_cache_seconds": 0.0})
        with TestClient(create_app(uncached)) as fresh:
            took = refused_after(fresh, auth(dave), rotated_at)  # the store's end of the grace
            assert took >= grace - 0.5, took  # (a slow machine only makes it later)
        # the entry cached during the grace ends with the key, not a ttl later
        assert client.get("/v1/jobs", headers=auth(dave)).status_code == 401
        assert client.get("/v1/jobs", headers=bearer(new_key)).status_code == 200
        listed = cli("keys", "list", "dave").output
        assert new_key not in listed and listed.count("\tactive") == 1


def test_rotate_takes_the_grace_from_the_setting_and_keeps_an_earlier_end(
    engine: Engine, settings: Settings, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    erin = make_user(engine, settings, name="erin")
    monkeypatch.setenv("FACEFLOW_KEY_ROTATION_GRACE_SECONDS", "120")
    get_settings.cache_clear()
    cli("keys", "rotate", "erin")
    with Session(engine) as session:
        first = session.get(ApiKey, erin.key_id)
        assert first is not None and first.revoked_at is not None
        first_end = first.revoked_at
        assert 110 < (first_end - first.created_at).total_seconds() < 130 + 30
    second = _printed_key(cli("keys", "rotate", "erin", "--grace", "3600").output)
    with Session(engine) as session:
        keys = crud.list_keys(session, name="erin")
    assert len(keys) == 3
    ends = {key.id: key.revoked_at for key in keys}
    assert ends[erin.key_id] == first_end  # ending sooner than the new grace: kept
    [middle] = [key for key in keys if key.id != erin.key_id and key.revoked_at is not None]
    assert middle.revoked_at is not None and middle.revoked_at > first_end
    with Session(engine) as session:
        found = crud.authenticate_key(
            session, api_key=second, pepper=settings.api_key_pepper.get_secret_value()
        )
    assert found is not None and found.valid_until is None


def test_key_cache_never_keeps_a_key_past_its_end() -> None:
    cache: KeyCache[str] = KeyCache(ttl_s=30)
    cache.put("a", "alice", valid_for_s=0.1)
    cache.put("b", "bob", valid_for_s=60)
    cache.put("c", "carol", valid_for_s=-1)  # already over: not kept
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("alice", "bob", None)
    time.sleep(0.15)
    assert (cache.get("a"), cache.get("b")) == (None, "bob")
