"""FastAPI dependencies as ``Annotated`` aliases: routes read like sentences.

The app keeps its settings, engine and object store on ``app.state`` (``create_app``), so
several apps (tests: one per database) live side by side in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from webapi import crud
from webapi.auth import KeyCache, hash_api_key, parse_bearer
from webapi.config import Settings
from webapi.errors import Unauthorized
from webapi.models import User, utcnow
from webapi.storage import ObjectStore

bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer ff_...")


async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings
    return settings


async def get_engine(request: Request) -> Engine:
    """The app's job-store engine."""
    engine: Engine = request.app.state.engine
    return engine


async def get_store(request: Request) -> ObjectStore:
    """The app's object store."""
    store: ObjectStore = request.app.state.store
    return store


def get_session(engine: Annotated[Engine, Depends(get_engine)]) -> Iterator[Session]:
    """A session for one request that writes, closed afterwards."""
    with Session(engine, expire_on_commit=False) as session:
        yield session


def get_read_session(request: Request) -> Iterator[Session]:
    """A read-only session for one request (never write through it), closed afterwards."""
    with Session(request.app.state.read_engine, expire_on_commit=False) as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]


async def get_current_user(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    """The user of the request's API key, or 401.

    Looked up in the app's ``KeyCache`` first (``settings.auth_cache_seconds``, never
    past the key's own end), else in a short read transaction of its own, ended before
    the route opens its own.
    """
    header = None if credentials is None else f"{credentials.scheme} {credentials.credentials}"
    api_key = parse_bearer(header)
    if api_key is None:
        raise Unauthorized()
    pepper = settings.api_key_pepper.get_secret_value()
    key_hash = hash_api_key(api_key, pepper)
    cache: KeyCache[User] = request.app.state.users
    user = cache.get(key_hash)
    if user is None:
        found = await run_in_threadpool(
            _authenticate, request.app.state.read_engine, api_key, pepper
        )
        if found is None:
            raise Unauthorized()
        user = found.user
        cache.put(key_hash, user, valid_for_s=_seconds_left(found.valid_until))
    return user


def _authenticate(engine: Engine, api_key: str, pepper: str) -> crud.Authenticated | None:
    with Session(engine, expire_on_commit=False) as session:
        found = crud.authenticate_key(session, api_key=api_key, pepper=pepper)
        session.commit()
        return found


def _seconds_left(until: datetime | None) -> float | None:
    return None if until is None else (until - utcnow()).total_seconds()


CurrentUser = Annotated[User, Depends(get_current_user)]
