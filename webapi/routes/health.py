"""Liveness, readiness and metrics."""

from __future__ import annotations

from typing import Any

import httpx
import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from webapi.deps import EngineDep, SettingsDep
from webapi.errors import error_body
from webapi.metrics import ApiMetrics

router = APIRouter(tags=["health"])

PREFECT_TIMEOUT_S = 2.0


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="The database and the Prefect API are reachable",
    responses={503: {"description": "A dependency is unreachable."}},
)
async def readyz(engine: EngineDep, settings: SettingsDep) -> JSONResponse:
    checks = {
        "database": await run_in_threadpool(_database_check, engine),
        "prefect": await _prefect_check(settings.prefect_api_url),
    }
    if all(value == "ok" for value in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    failed = ", ".join(name for name, value in checks.items() if value != "ok")
    body: dict[str, Any] = error_body("not_ready", f"Unreachable: {failed}.")
    body["checks"] = checks
    return JSONResponse(body, status_code=503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry: ApiMetrics = request.app.state.metrics
    text = await run_in_threadpool(registry.render)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _database_check(engine: sa.Engine) -> str:
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except Exception as exc:
        return f"error: {type(exc).__name__}"
    return "ok"


async def _prefect_check(api_url: str) -> str:
    try:
        async with httpx.AsyncClient(timeout=PREFECT_TIMEOUT_S) as client:
            response = await client.get(f"{api_url.rstrip('/')}/health")
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}"
    return "ok" if response.status_code == 200 else f"error: HTTP {response.status_code}"
