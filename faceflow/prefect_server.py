"""How the local stack runs the Prefect server: embedded (one process, SQLite) or scale-out.

Scale-out is Prefect's production layout ("How to scale self-hosted Prefect"): the API in
several processes (``prefect server start --no-services --workers N``; one uvicorn socket,
N processes), the background services (scheduler, late runs, event persisters, triggers,
task-run recorder...) in their own process (``prefect server services start``), state in
PostgreSQL and events, the message cache, causal ordering, concurrency leases and Docket
in Redis (``prefect-redis``). Migrations run once, before any API process starts, because
several processes must not migrate at the same time. A real deployment puts more API
replicas behind a load balancer with the same environment; ``docs/prefect-scale-out.md``.

In both layouts the API asks for HTTP basic auth (``PREFECT_SERVER_API_AUTH_STRING``; its
clients send ``PREFECT_API_AUTH_STRING``): the stack makes the credential at its first
start, in a file only its owner can read, and gives it to every process it starts.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

PrefectMode = Literal["embedded", "scale-out"]

DEFAULT_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/faceflow_prefect"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

REDIS_SERVER_MODULES = {
    "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
    "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
    "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
}
"""The server settings that move Prefect's in-memory parts to Redis (all four are needed
for ``--workers`` > 1: ``prefect.cli._server_utils._validate_multi_worker``)."""


REDIS_PUBLISH_AT_ONCE = {"PREFECT_REDIS_MESSAGING_PUBLISHER_BATCH_SIZE": "1"}
"""Redis messaging publishes each message at once rather than 5 at a time or every 10 s
(prefect-redis' default): a run's state event reaches the relay's event stream
(``webapi.relay.run_events``) within milliseconds, not after up to 10 s."""


SERVICE_WRITE_BATCHING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}
"""The task-run recorder and the event persister write in batches, at least every second,
instead of Prefect's defaults (the recorder one task-run event per insert, the persister 20
events or every 5 s). Every task run and event is still recorded (the UI's per-stage view
and event feed lag by a second at most); the server spends 23-34 % less CPU per flow run
(``bench/prefect_costs.py``, docs/batching.md)."""


AUTH_FILE = "prefect-api-auth"
"""The stack's Prefect API credential, under its home (mode 0600)."""
AUTH_USER = "faceflow"
SERVER_AUTH_VAR = "PREFECT_SERVER_API_AUTH_STRING"
"""What the server asks for (every server process: API, services, migrations)."""
CLIENT_AUTH_VAR = "PREFECT_API_AUTH_STRING"
"""What Prefect's clients send (workers, flow runs, the CLI, blocks) and the relay too
(``webapi.config.Settings.prefect_api_auth_string``)."""


class AuthFileError(RuntimeError):
    """The credential file is unusable: others may read it, or it is empty."""


def new_auth_string() -> str:
    """A fresh credential: ``faceflow:<256 random bits, URL-safe base64>``."""
    return f"{AUTH_USER}:{secrets.token_urlsafe(32)}"


def write_auth_env(path: Path, *, replace: bool = False) -> None:
    """Write a new credential as an environment file for systemd's ``EnvironmentFile=``:
    the server's and the clients' variable with one value, mode 0600, replaced atomically
    (``replace``: a rotation; otherwise an existing file is an ``AuthFileError``)."""
    if path.exists() and not replace:
        raise AuthFileError(f"{path} exists: pass --replace to rotate the credential")
    credential = new_auth_string()
    text = f"{SERVER_AUTH_VAR}={credential}\n{CLIENT_AUTH_VAR}={credential}\n"
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def ensure_auth_string(path: Path) -> str:
    """The Prefect API credential kept in ``path``: ``faceflow:<256 random bits>``, written
    with mode 0600 at the first start and read again at every later one (``read_auth_string``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    credential = new_auth_string()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_auth_string(path)
    with os.fdopen(fd, "w") as out:
        out.write(credential + "\n")
    return credential


def read_auth_string(path: Path) -> str:
    """The credential in ``path``. A file that its group or others may read is refused:
    the credential may have leaked (remove the file to make a new one: a rotation)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise AuthFileError(
            f"{path} has mode {mode:04o}: its group or others may read the Prefect API "
            "credential; remove the file (a new credential is made at the next start) "
            "or chmod 600 it"
        )
    credential = path.read_text().strip()
    if not credential:
        raise AuthFileError(f"{path} is empty: remove it to make a new credential")
    return credential


def services_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Settings of the process that runs the server's services (the API process when
    embedded): ``SERVICE_WRITE_BATCHING``, except those the operator set in ``environ``
    (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in SERVICE_WRITE_BATCHING.items() if name not in environ}


def scale_out_env(database_url: str, redis_url: str) -> dict[str, str]:
    """Environment of every scale-out server process (API processes, services, migrations)."""
    return {
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_API_DATABASE_MIGRATE_ON_START": "false",
        **REDIS_SERVER_MODULES,
        "PREFECT_REDIS_MESSAGING_URL": redis_url,
        "PREFECT_SERVER_DOCKET_URL": redis_url,
        **REDIS_PUBLISH_AT_ONCE,
    }


#: ``prefect`` as the stack runs its server processes: this interpreter's Prefect with the
#: server's schema checks cached (``faceflow.prefect_main``, ``faceflow.prefect_schema_cache``).
SERVER_PREFECT = (sys.executable, "-m", "faceflow.prefect_main")


def api_argv(port: int, mode: PrefectMode, api_workers: int) -> list[str]:
    """``prefect server start`` for the mode: embedded runs the services in the API process;
    scale-out runs ``api_workers`` API processes without them (``SERVER_PREFECT``)."""
    argv = [*SERVER_PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    if mode == "scale-out":
        argv += ["--no-services", "--workers", str(api_workers)]
    return argv


def services_argv() -> list[str]:
    """The background services in one process of their own (scale-out only)."""
    return [*SERVER_PREFECT, "server", "services", "start"]


def migrate_argv(prefect: str) -> list[str]:
    """The server database's migrations, run once before the API processes start."""
    return [prefect, "server", "database", "upgrade", "-y"]


def redacted(url: str) -> str:
    """A database or Redis URL without its password, for the console."""
    return make_url(url).render_as_string(hide_password=True)


def ensure_database(database_url: str) -> bool:
    """Create the server's PostgreSQL database if it does not exist; True if created.

    Connects to the ``postgres`` maintenance database of the same server with the URL's
    credentials (a managed database that the operator created is left alone)."""
    url = make_url(database_url)
    if not url.database:
        raise ValueError(f"the Prefect database URL names no database: {url!r}")
    params: Mapping[str, object] = {
        "host": url.host or "127.0.0.1",
        "port": url.port or 5432,
        "user": url.username or "postgres",
        "password": url.password or None,
        "dbname": "postgres",
        "connect_timeout": 10,
        "autocommit": True,
    }
    with psycopg.connect(**params) as conn:  # type: ignore[arg-type]
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (url.database,)
        ).fetchone()
        if exists:
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(url.database)))
    return True
