"""The Prefect server layouts of the local stack (``faceflow.prefect_server``)."""

from __future__ import annotations

import os
import stat
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from faceflow import prefect_server
from faceflow.stack import Stack, StackConfig
from faceflow.supervisor import ServiceFailed
from faceflow.testing.databases import postgres_unavailable


def test_embedded_is_one_process_with_its_services() -> None:
    argv = prefect_server.api_argv(4200, "embedded", 4)
    launcher = [sys.executable, "-m", "faceflow.prefect_main"]  # Prefect, schema checks cached
    assert argv == [*launcher, "server", "start", "--host", "127.0.0.1", "--port", "4200"]
    assert prefect_server.services_argv() == [*launcher, "server", "services", "start"]
    env = StackConfig(prefect_mode="embedded", prefect_auth_string=None).server_env()
    assert env == prefect_server.SERVICE_WRITE_BATCHING  # its services write in batches


def test_the_services_write_in_batches_unless_the_operator_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"
    for mode in ("embedded", "scale-out"):
        env = StackConfig(prefect_mode=mode).server_env()
        assert int(env[recorder]) > 1  # Prefect's default inserts one task-run event at a time
        assert int(env["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE"]) > 20
        for name in (
            "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL",
            "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL",
        ):
            assert int(env[name]) == 1  # the UI lags by a second at most (int: Prefect's cast)
    monkeypatch.setenv(recorder, "1")
    assert recorder not in StackConfig(prefect_mode="embedded").server_env()
    assert recorder not in prefect_server.services_env({recorder: "7"})


def test_scale_out_moves_every_in_memory_part_to_redis_and_state_to_postgres() -> None:
    argv = prefect_server.api_argv(4200, "scale-out", 3)
    assert argv[-3:] == ["--no-services", "--workers", "3"]
    assert "127.0.0.1" in argv  # loopback only, like every service of the local stack
    env = StackConfig(
        prefect_mode="scale-out",
        prefect_database_url="postgresql+asyncpg://u:p@db:5432/pf",
        prefect_redis_url="redis://cache:6379/2",
    ).server_env()
    # what prefect.cli._server_utils._validate_multi_worker requires for --workers > 1
    for name in ("PREFECT_MESSAGING_BROKER", "PREFECT_MESSAGING_CACHE"):
        assert env[name] == "prefect_redis.messaging"
    assert env["PREFECT_SERVER_EVENTS_CAUSAL_ORDERING"] == "prefect_redis.ordering"
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == "prefect_redis.lease_storage"
    assert env["PREFECT_REDIS_MESSAGING_URL"] == env["PREFECT_SERVER_DOCKET_URL"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert env["PREFECT_API_DATABASE_MIGRATE_ON_START"] == "false"  # migrated once, first
    for module in set(prefect_server.REDIS_SERVER_MODULES.values()):
        __import__(module)  # the modules exist in the installed prefect-redis


@pytest.mark.postgres
def test_ensure_database_creates_it_once() -> None:
    name = f"faceflow_prefect_t{uuid.uuid4().hex[:8]}"
    url = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    if why := postgres_unavailable():
        pytest.skip(why)
    try:
        assert prefect_server.ensure_database(url) is True
        assert prefect_server.ensure_database(url) is False
    finally:
        with psycopg.connect(
            "host=127.0.0.1 user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
    with pytest.raises(ValueError):
        prefect_server.ensure_database("postgresql+asyncpg://postgres@127.0.0.1:5432")


def test_the_stack_makes_its_prefect_credential_once_readable_by_its_owner_only(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    first = StackConfig(home=tmp_path / "home", external_prefect=None, prefect_auth_string=None)
    path = Stack(first, progress=said.append).prefect_credential()
    assert path == tmp_path / "home" / prefect_server.AUTH_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = first.prefect_auth_string
    assert secret and secret.startswith("faceflow:") and len(secret.split(":", 1)[1]) >= 43
    assert path.read_text().strip() == secret
    assert str(path) in said[0] and secret.split(":", 1)[1] not in "".join(said)
    # The server asks for it, every child (workers, flow runs, CLI steps, the relay) sends it.
    for mode in ("embedded", "scale-out"):
        first.prefect_mode = mode  # type: ignore[assignment]
        assert first.server_env()[prefect_server.SERVER_AUTH_VAR] == secret
    assert first.env()[prefect_server.CLIENT_AUTH_VAR] == secret
    assert secret not in repr(first)

    again = StackConfig(home=tmp_path / "home", external_prefect=None, prefect_auth_string=None)
    Stack(again, progress=said.append).prefect_credential()
    assert again.prefect_auth_string == secret  # the next start reuses it

    other = StackConfig(home=tmp_path / "other", external_prefect=None)
    Stack(other, progress=said.append).prefect_credential()
    assert other.prefect_auth_string != secret  # one per stack home


def test_a_credential_file_others_may_read_is_refused(tmp_path: Path) -> None:
    config = StackConfig(home=tmp_path, external_prefect=None)
    path = Stack(config, progress=lambda _: None).prefect_credential()
    os.chmod(path, 0o644)
    with pytest.raises(ServiceFailed, match="mode 0644"):
        Stack(StackConfig(home=tmp_path), progress=lambda _: None).prefect_credential()
    path.write_text("")
    os.chmod(path, 0o600)
    with pytest.raises(ServiceFailed, match="empty"):
        Stack(StackConfig(home=tmp_path), progress=lambda _: None).prefect_credential()
    path.unlink()  # the rotation: a new credential at the next start
    renewed = StackConfig(home=tmp_path)
    Stack(renewed, progress=lambda _: None).prefect_credential()
    assert renewed.prefect_auth_string and renewed.prefect_auth_string != config.prefect_auth_string


def test_an_existing_server_gets_the_credential_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(prefect_server.CLIENT_AUTH_VAR, "ops:from-the-environment")
    config = StackConfig(external_prefect="http://127.0.0.1:9/api")
    assert config.env()[prefect_server.CLIENT_AUTH_VAR] == "ops:from-the-environment"
    monkeypatch.delenv(prefect_server.CLIENT_AUTH_VAR)
    assert prefect_server.CLIENT_AUTH_VAR not in StackConfig(external_prefect="x").env()


def test_faceflow_prefect_auth_writes_the_units_credential_and_rotates_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from faceflow.cli import app

    path = tmp_path / "prefect-auth.env"
    runner = CliRunner()
    made = runner.invoke(app, ["prefect-auth", str(path)])
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = dict(line.split("=", 1) for line in path.read_text().splitlines())
    assert set(lines) == {prefect_server.SERVER_AUTH_VAR, prefect_server.CLIENT_AUTH_VAR}
    (credential,) = set(lines.values())  # the server asks for what the clients send
    assert credential.startswith("faceflow:") and credential not in made.output

    again = runner.invoke(app, ["prefect-auth", str(path)])
    assert again.exit_code == 1 and "--replace" in again.output
    assert credential in path.read_text()  # left alone
    rotated = runner.invoke(app, ["prefect-auth", str(path), "--replace"])
    assert rotated.exit_code == 0 and credential not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
