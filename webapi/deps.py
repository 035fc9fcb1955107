"""FastAPI dependencies as ``Annotated`` aliases: routes read like sentences.

The app keeps its settings, engine and object store on ``app.state`` (``create_app``), so
several apps (tests: one per database) live side by side in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from sqlmodel import Session

from webapi import crud
from webapi.auth import parse_bearer
from webapi.config import Settings
from webapi.errors import Unauthorized
from webapi.models import User
from webapi.storage import ObjectStore

bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer ff_...")


def get_settings(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings
    return settings


def get_engine(request: Request) -> Engine:
    """The app's job-store engine."""
    engine: Engine = request.app.state.engine
    return engine


def get_store(request: Request) -> ObjectStore:
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


def get_current_user(
    session: ReadSessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    """The user of the request's API key, or 401.

    Ends its read transaction at once, before the route opens its own.
    """
    header = None if credentials is None else f"{credentials.scheme} {credentials.credentials}"
    api_key = parse_bearer(header)
    user = None
    if api_key is not None:
        user = crud.authenticate(
            session, api_key=api_key, pepper=settings.api_key_pepper.get_secret_value()
        )
    session.commit()
    if user is None:
        raise Unauthorized()
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]
