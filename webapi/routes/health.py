"""Liveness, readiness and metrics."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from webapi.deps import EngineDep
from webapi.errors import error_body
from webapi.metrics import ApiMetrics
from webapi.readiness import OK, PrefectReadiness

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="The database and the Prefect API can be used",
    description="The database answers, and so does the Prefect API: to this API's "
    "credential when it runs the relay (`credential refused` on 401 or 403, apart from "
    "`unreachable`). The Prefect check is cached for a few seconds.",
    responses={503: {"description": "A dependency is unreachable or refuses this API."}},
)
async def readyz(request: Request, engine: EngineDep) -> JSONResponse:
    prefect: PrefectReadiness = request.app.state.prefect_readiness
    checks = {
        "database": await run_in_threadpool(_database_check, engine),
        "prefect": await prefect.check(),
    }
    if all(value == OK for value in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    failed = "; ".join(f"{name}: {value}" for name, value in checks.items() if value != OK)
    body: dict[str, Any] = error_body("not_ready", f"Not ready: {failed}.")
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
    return OK
