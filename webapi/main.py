"""The FastAPI app: ``create_app(settings)``; ``uvicorn webapi.main:app`` (or
``uvicorn --factory webapi.main:create_app``, as ``faceflow up`` runs it) serves the default,
logging JSON lines at INFO.

The lifespan refuses to start on an unmigrated job store (``DatabaseNotMigrated`` with
the command to run) and starts the relay loops in-process when ``settings.run_relay``.
Nothing here imports torch, the pipeline or prefect.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool

from webapi import errors
from webapi.auth import KeyCache
from webapi.bodies import BodyDeadlineMiddleware
from webapi.config import Settings, get_settings
from webapi.db import get_engine, read_only
from webapi.group_commit import GroupCommit
from webapi.inputs import warm_up
from webapi.job_ends import EndListener
from webapi.logs import RequestIdMiddleware, configure_logging
from webapi.metrics import ApiMetrics
from webapi.migrations import check_migrated
from webapi.models import User
from webapi.readiness import PrefectReadiness
from webapi.routes import health, jobs, verify
from webapi.storage import open_store

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, json_logs: bool | None = None) -> FastAPI:
    """A configured app (the engine is created now, connections only on first use).

    ``json_logs``: send every log record to stderr as JSON lines at INFO
    (``configure_logging``). Default: when the settings come from the environment, as for a
    server (``uvicorn --factory webapi.main:create_app`` calls this without arguments);
    apps built with explicit settings (tests, embedding) leave logging alone."""
    if json_logs is None:
        json_logs = settings is None
    if json_logs:
        configure_logging()
    settings = settings or get_settings()
    app = FastAPI(
        title="FaceFlow",
        version="0.1.0",
        summary="Face fusion as a service: submit a job, poll it or receive a signed webhook.",
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.engine = get_engine(settings.database_url)
    app.state.read_engine = read_only(app.state.engine)
    app.state.store = open_store(settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url)
    app.state.metrics = ApiMetrics(app.state.engine, settings)
    app.state.users = KeyCache[User](settings.auth_cache_seconds)
    app.state.submit_limiter = anyio.CapacityLimiter(settings.submit_threads)
    app.state.verify_limiter = anyio.CapacityLimiter(settings.verify_threads)
    app.state.verify_rate = verify.VerifyLimiter(settings.verify_per_minute)
    app.state.group_commit = GroupCommit(app.state.engine, settings, store=app.state.store)
    app.state.prefect_readiness = PrefectReadiness.from_settings(settings)
    app.state.relay = None
    errors.install(app)
    app.add_middleware(
        BodyDeadlineMiddleware,
        seconds=settings.body_read_seconds,
        min_rate=settings.body_min_bytes_per_second,
    )
    app.add_middleware(RequestIdMiddleware)
    app.include_router(jobs.router)
    app.include_router(health.router)
    app.include_router(verify.router)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    await run_in_threadpool(check_migrated, app.state.engine)
    await run_in_threadpool(warm_up, settings.image_limits)
    relay = _relay_module() if settings.run_relay else None
    if relay is not None:
        await _maybe_await(relay.start_relay(app.state))
    listener = (
        EndListener(settings.database_url) if EndListener.wanted(settings.database_url) else None
    )
    if listener is not None:
        listener.start()  # job ends committed by other processes (replicas, a separate relay)
    _freeze_heap()
    try:
        yield
    finally:
        if listener is not None:
            await run_in_threadpool(listener.stop)
        await run_in_threadpool(app.state.group_commit.close)
        app.state.prefect_readiness.close()
        if relay is not None:
            await _maybe_await(await run_in_threadpool(relay.stop_relay, app.state))


def _freeze_heap() -> None:
    """Leave every object alive after start-up out of the cyclic garbage collector's scans.

    Full collections otherwise walk the whole heap of imported modules (FastAPI, pydantic,
    SQLAlchemy, Pillow: ≈ 80 ms here) a few times a minute under load, each one a pause
    that every in-flight request waits through; frozen, they scan only what requests
    allocate. Objects freed by reference counting are unaffected.
    """
    gc.collect()
    gc.freeze()


def _relay_module() -> Any:
    try:
        return importlib.import_module("webapi.relay.runner")
    except ModuleNotFoundError as exc:
        if exc.name != "webapi.relay.runner":
            raise
        log.warning("webapi.relay.runner is not available: the relay does not run in-process")
        return None


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                jobs.openapi_components()
            )
            app.openapi_schema = schema
        return app.openapi_schema

    return build


def __getattr__(name: str) -> Any:
    """``webapi.main:app`` for uvicorn: JSON logs, settings from the environment."""
    if name == "app":
        globals()["app"] = value = create_app(json_logs=True)
        return value
    raise AttributeError(name)
