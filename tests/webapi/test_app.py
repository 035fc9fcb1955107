"""App start-up, health, metrics, migrations, the CLI and the import budget."""

from __future__ import annotations

import http.server
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel
from typer.testing import CliRunner

from faceflow.testing.jobs import auth, job_body, make_user
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.cli import app as cli_app
from webapi.config import Settings, SettingsError
from webapi.db import create_engine
from webapi.main import create_app
from webapi.migrations import DatabaseNotMigrated, check_migrated, head_revision

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- start-up


def test_unmigrated_database_is_refused_with_the_command_to_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    app = create_app(make_settings(url, tmp_path))
    with pytest.raises(DatabaseNotMigrated, match="faceflow db upgrade"), TestClient(app):
        pass


def test_migrations_match_the_models(engine: Engine) -> None:
    check_migrated(engine)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
    assert diff == []


def test_production_refuses_development_secrets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="API_KEY_PEPPER"):
        Settings.model_validate({"environment": "production", "home": tmp_path})
    with pytest.raises(ValueError, match="PRIVATE_URLS"):
        Settings.model_validate(
            {
                "environment": "production",
                "api_key_pepper": "s3cret-pepper",
                "allow_private_urls": True,
            }
        )
    with pytest.raises(ValueError, match="RUN_SIGNING_KEY"):
        Settings.model_validate({"environment": "production", "api_key_pepper": "s3cret-pepper"})
    ok = Settings.model_validate(
        {
            "environment": "production",
            "api_key_pepper": "s3cret-pepper",
            "run_signing_key": "s3cret-run-key",
            "home": tmp_path,
        }
    )
    assert ok.database_url == f"sqlite:///{(tmp_path / 'webapi.db').resolve()}"
    assert ok.storage_url == (tmp_path / "storage").resolve().as_uri()
    assert issubclass(SettingsError, ValueError)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FACEFLOW_IMAGE_LIMITS__MAX_BYTES", "12345")
    monkeypatch.setenv("FACEFLOW_STORAGE_URL", "s3://bucket/prefix")
    settings = Settings.model_validate({})
    assert settings.image_limits.max_bytes == 12345
    assert settings.database_url.endswith(f"{tmp_path}/webapi.db")
    assert settings.storage_url == "s3://bucket/prefix"
    assert settings.default_deadline_seconds == 120 and settings.default_queue_timeout_seconds == 60


# --------------------------------------------------------------------------- health


@pytest.fixture
def fake_prefect() -> Iterator[str]:
    """A real HTTP server on loopback answering ``GET /api/health`` like Prefect."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/api/health"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"true" if ok else b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


def test_healthz_and_readyz(
    database_url: str, tmp_path: Path, engine: Engine, fake_prefect: str
) -> None:
    with TestClient(
        create_app(make_settings(database_url, tmp_path, prefect_api_url=fake_prefect))
    ) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"database": "ok", "prefect": "ok"}
    with TestClient(create_app(make_settings(database_url, tmp_path))) as client:  # port 9: closed
        down = client.get("/readyz")
        assert down.status_code == 503
        assert down.json()["error"]["code"] == "not_ready"
        assert down.json()["checks"]["database"] == "ok"
        assert down.json()["checks"]["prefect"].startswith("unreachable: GET health")
        assert client.get("/healthz").status_code == 200


def test_metrics(client: TestClient, engine: Engine, settings: Settings) -> None:
    user = make_user(engine, settings)
    assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 202
    assert client.post("/v1/jobs", json={"source": 1}, headers=auth(user)).status_code == 422
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'faceflow_jobs{status="queued"} 1.0' in text
    assert 'faceflow_jobs{status="succeeded"} 0.0' in text
    assert "faceflow_queue_depth 1.0" in text
    assert 'faceflow_submit_latency_seconds_count{outcome="202"} 1.0' in text
    assert 'faceflow_submit_latency_seconds_count{outcome="422"} 1.0' in text


# --------------------------------------------------------------------------- CLI


def test_cli_db_upgrade_and_users_create(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    from webapi.config import get_settings

    get_settings.cache_clear()
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    runner = CliRunner()
    try:
        refused = runner.invoke(cli_app, ["users", "create", "alice", "--database-url", url])
        assert refused.exit_code == 1 and "faceflow db upgrade" in refused.output
        upgraded = runner.invoke(cli_app, ["db", "upgrade", "--database-url", url])
        assert upgraded.exit_code == 0 and head_revision() in upgraded.output
        assert runner.invoke(cli_app, ["db", "check", "--database-url", url]).exit_code == 0
        created = runner.invoke(
            cli_app, ["users", "create", "alice", "--quota", "3", "--database-url", url]
        )
        assert created.exit_code == 0, created.output
        lines = dict(line.split(":", 1) for line in created.stdout.splitlines() if ":" in line)
        api_key, secret = lines["api key"].strip(), lines["webhook secret"].strip()
        assert api_key.startswith("ff_") and secret.startswith("whsec_")
        duplicate = runner.invoke(cli_app, ["users", "create", "alice", "--database-url", url])
        assert duplicate.exit_code == 1
        listed = runner.invoke(cli_app, ["users", "list", "--database-url", url])
        assert (
            "alice" in listed.output
            and api_key not in listed.output
            and secret not in listed.output
        )

        engine = create_engine(url)
        pepper = get_settings().api_key_pepper.get_secret_value()
        with Session(engine) as session:
            user = crud.authenticate(session, api_key=api_key, pepper=pepper)
            assert user is not None and user.name == "alice" and user.quota == 3
            assert user.webhook_secret == secret
            assert crud.authenticate(session, api_key=api_key + "x", pepper=pepper) is None
            assert crud.authenticate(session, api_key=api_key, pepper="other") is None
            stored = session.execute(sa.text("SELECT key_hash FROM api_keys")).scalar_one()
            assert api_key not in stored and len(stored) == 64
        engine.dispose()
    finally:
        get_settings.cache_clear()


# --------------------------------------------------------------------------- imports


def test_webapi_never_imports_torch_or_prefect(tmp_path: Path) -> None:
    """Serving a submit end to end loads neither torch, the pipeline nor prefect."""
    script = textwrap.dedent(
        f"""
        import importlib.util
        import sys
        import webapi.main, webapi.cli
        if importlib.util.find_spec("webapi.relay.runner") is not None:
            import webapi.relay.runner  # the in-process relay must be as light
        from fastapi.testclient import TestClient
        from sqlmodel import Session
        from tests.webapi.conftest import make_settings
        from faceflow.testing.jobs import auth, job_body, make_user
        from webapi.migrations import upgrade
        from pathlib import Path

        tmp = Path({str(tmp_path)!r})
        url = f"sqlite:///{{tmp / 'imports.db'}}"
        upgrade(url)
        settings = make_settings(url, tmp)
        app = webapi.main.create_app(settings)
        with TestClient(app) as client:
            user = make_user(app.state.engine, settings)
            response = client.post("/v1/jobs", json=job_body(), headers=auth(user))
            assert response.status_code == 202, response.text
            assert client.get("/metrics").status_code == 200
        heavy = sorted(
            name for name in sys.modules
            if name.split(".")[0] in ("torch", "prefect", "prefect_aws", "cv2", "onnxruntime")
            or name in ("tasks.detect", "tasks.fuse", "tasks.pipeline", "tasks.models")
        )
        print("HEAVY", heavy)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout, result.stdout


# --------------------------------------------------------------------------- logs


def test_request_ids_and_json_logs(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    from webapi.logs import JsonFormatter, log_context, redact_url

    given = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = client.get("/healthz", headers={"X-Request-ID": "bad id\\n"})
    assert len(made.headers["x-request-id"]) == 32

    record = logging.LogRecord("webapi.test", logging.INFO, __file__, 1, "hello %s", ("x",), None)
    with log_context(job="j-1", attempt_no=2):
        line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "hello x" and line["job_id"] == "j-1" and line["attempt"] == 2
    assert "job_id" not in json.loads(JsonFormatter().format(record))
    assert redact_url("https://u:pw@h.example:8443/p?token=s#f") == "https://h.example:8443/p"
