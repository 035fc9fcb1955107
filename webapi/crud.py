"""Job-store operations: keyword-only, session first. Routes call these and nothing else.

Submit is one transaction: the job row and its ``dispatch`` outbox row commit together
(invariant 1), after the per-user quota (429) and global backlog (503) checks of the
capacity model (``webapi.capacity``). The user's
row is locked first (``FOR UPDATE`` on PostgreSQL; SQLite transactions are
``BEGIN IMMEDIATE``), so a user's concurrent submits see each other; the unique
constraint on ``(owner_id, idempotency_key)`` is the last word on duplicates.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from tasks.error_codes import JobErrorCode
from webapi import capacity
from webapi.auth import hash_api_key, key_matches, new_api_key, new_webhook_secret
from webapi.config import Settings
from webapi.errors import (
    ApiError,
    IdempotencyKeyReused,
    InputsPurged,
    InvalidRequest,
    JobNotCancellable,
    NotFound,
    PriorityNotAllowed,
    Unauthorized,
)
from webapi.inputs import InputRef, job_pixels, looks_like_video
from webapi.jobstate import transition
from webapi.models import (
    DEFAULT_CALLBACK_EVENTS,
    ApiKey,
    Job,
    JobCreate,
    JobStatus,
    Outbox,
    Priority,
    User,
    WebhookDelivery,
    utcnow,
)
from webapi.storage import ObjectStore

MAX_PAGE = 100
#: How far back a retention pass's deletion of an input counts against a submit that
#: found the input already stored (clock skew between replicas, a slow submit).
INPUT_PURGE_MARGIN_S = 60.0

# --------------------------------------------------------------------------- users


@dataclass(frozen=True)
class NewUser:
    """A created user with the secrets shown once."""

    user: User
    api_key: str
    webhook_secret: str
    key_id: uuid.UUID


def create_user(
    session: Session,
    *,
    name: str,
    quota: int,
    pepper: str,
    priority: Priority = "normal",
    input_retention_s: int | None = None,
    result_retention_s: int | None = None,
) -> NewUser:
    """Create a user with one API key and a webhook secret; commits. ``priority`` is the
    user's priority class; the retention times (seconds) override the settings' for this
    user's jobs when given."""
    user = User(
        name=name,
        quota=quota,
        priority=priority,
        input_retention_s=input_retention_s,
        result_retention_s=result_retention_s,
        webhook_secret=new_webhook_secret(),
    )
    session.add(user)
    try:
        session.flush()  # users before api_keys (no ORM relationship orders them)
        api_key, key = _add_key(session, user_id=user.id, pepper=pepper)
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise InvalidRequest(f"a user named {name!r} already exists") from exc
    return NewUser(user=user, api_key=api_key, webhook_secret=user.webhook_secret, key_id=key.id)


#: What ``update_user`` may change.
USER_SETTINGS = frozenset({"quota", "priority", "input_retention_s", "result_retention_s"})


def update_user(session: Session, *, name: str, **changes: Any) -> User:
    """Change a user's quota, priority class or retention times (``None`` for a retention
    time: back to the settings'); commits. New values apply to jobs submitted afterwards
    (within ``auth_cache_seconds`` on a running API)."""
    unknown = sorted(set(changes) - USER_SETTINGS)
    if unknown:
        raise InvalidRequest(f"not user settings: {', '.join(unknown)}")
    user = user_named(session, name=name)
    for key, value in changes.items():
        setattr(user, key, value)
    session.add(user)
    session.commit()
    session.refresh(user)
    return user


def user_named(session: Session, *, name: str) -> User:
    """The user called ``name``; ``NotFound`` if there is none."""
    user = session.exec(select(User).where(col(User.name) == name)).first()
    if user is None:
        raise NotFound(f"no user named {name!r}")
    return user


def list_users(session: Session) -> Sequence[User]:
    """Every user, oldest first."""
    return session.exec(select(User).order_by(col(User.created_at))).all()


@dataclass(frozen=True)
class Disabled:
    """A user just disabled and what became of their unfinished jobs."""

    user: User
    cancelled: int
    cancel_requested: int


def disable_user(session: Session, *, name: str) -> Disabled:
    """Disable a user; commits. Their keys are refused (within ``auth_cache_seconds`` on
    a running API; a submit at once: admission reads the flag under the user-row lock),
    their webhooks are no longer sent (``relay.notify``), and their unfinished jobs are
    cancelled: queued ones at once, running ones through a cancel request."""
    user = _set_disabled(session, name=name, disabled=True)
    counts = cancel_jobs_of(session, owner_id=user.id, message=USER_DISABLED_MESSAGE)
    return Disabled(
        user=user,
        cancelled=counts[JobStatus.cancelled],
        cancel_requested=counts[JobStatus.cancel_requested],
    )


def enable_user(session: Session, *, name: str) -> User:
    """Enable a disabled user again (jobs cancelled meanwhile stay cancelled); commits."""
    return _set_disabled(session, name=name, disabled=False)


def _set_disabled(session: Session, *, name: str, disabled: bool) -> User:
    user = user_named(session, name=name)
    user.disabled = disabled
    session.add(user)
    session.commit()  # before a disable's sweep: a submit committed after it is refused
    session.refresh(user)
    return user


@dataclass(frozen=True)
class Authenticated:
    """The user of a valid API key, and until when the key stays valid (None: revoked
    only by a later command)."""

    user: User
    key_id: uuid.UUID
    valid_until: datetime | None


def authenticate(session: Session, *, api_key: str, pepper: str) -> User | None:
    """The enabled user owning ``api_key`` (not revoked), or None."""
    found = authenticate_key(session, api_key=api_key, pepper=pepper)
    return None if found is None else found.user


def authenticate_key(
    session: Session, *, api_key: str, pepper: str, now: datetime | None = None
) -> Authenticated | None:
    """The enabled user of ``api_key`` if the key is valid now (not revoked, or in a
    rotation's grace period: ``revoked_at`` still ahead), or None."""
    now = now or utcnow()
    key_hash = hash_api_key(api_key, pepper)
    row = session.exec(
        select(ApiKey, User)
        .join(User, col(User.id) == col(ApiKey.user_id))
        .where(
            col(ApiKey.key_hash) == key_hash,
            sa.or_(col(ApiKey.revoked_at).is_(None), col(ApiKey.revoked_at) > now),
        )
    ).first()
    if row is None:
        return None
    key, user = row
    if user.disabled or not key_matches(api_key, key.key_hash, pepper):
        return None
    return Authenticated(user=user, key_id=key.id, valid_until=key.revoked_at)


def list_keys(session: Session, *, name: str) -> Sequence[ApiKey]:
    """A user's API keys (hashes only), oldest first."""
    user = user_named(session, name=name)
    return session.exec(
        select(ApiKey).where(col(ApiKey.user_id) == user.id).order_by(col(ApiKey.created_at))
    ).all()


def revoke_key(session: Session, *, key_id: uuid.UUID, now: datetime | None = None) -> ApiKey:
    """Revoke one API key now (a key already revoked keeps its time); commits. Refused
    within ``auth_cache_seconds`` on a running API. ``NotFound`` for an unknown id."""
    now = now or utcnow()
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound(f"no API key {key_id}")
    if key.revoked_at is None or key.revoked_at > now:
        key.revoked_at = now
        session.add(key)
    session.commit()
    session.refresh(key)
    return key


@dataclass(frozen=True)
class Rotated:
    """A new API key (shown once) and the user's older keys, now ending with the grace."""

    user: User
    api_key: str
    key: ApiKey
    old: Sequence[ApiKey]


def rotate_key(
    session: Session, *, name: str, pepper: str, grace_s: float, now: datetime | None = None
) -> Rotated:
    """Give a user a new API key; every older key of theirs still valid then stops at
    ``now + grace_s`` (a key ending sooner keeps its end); commits."""
    now = now or utcnow()
    ends = now + timedelta(seconds=grace_s)
    user = user_named(session, name=name)
    old = session.exec(
        select(ApiKey).where(
            col(ApiKey.user_id) == user.id,
            sa.or_(col(ApiKey.revoked_at).is_(None), col(ApiKey.revoked_at) > ends),
        )
    ).all()
    for key in old:
        key.revoked_at = ends
        session.add(key)
    api_key, new = _add_key(session, user_id=user.id, pepper=pepper)
    session.commit()
    session.refresh(new)
    older = [key for key in list_keys(session, name=name) if key.id != new.id]
    return Rotated(
        user=user,
        api_key=api_key,
        key=new,
        old=[key for key in older if key.revoked_at is None or key.revoked_at > now],
    )


def _add_key(session: Session, *, user_id: uuid.UUID, pepper: str) -> tuple[str, ApiKey]:
    """A new API key of ``user_id``, added to the session: (the key, its row)."""
    api_key = new_api_key()
    key = ApiKey(user_id=user_id, key_hash=hash_api_key(api_key, pepper), prefix=api_key[:10])
    session.add(key)
    return api_key, key


# --------------------------------------------------------------------------- submit


def request_digest(
    create: JobCreate,
    source: InputRef,
    target: InputRef,
    extra_sources: Sequence[InputRef] = (),
    references: Sequence[InputRef] = (),
    priority: Priority | None = None,
) -> str:
    """sha256 hex over every input and every option: what "the same request" means
    (``priority``: the job's lane, when the request left it to the key's class)."""
    document: dict[str, object] = {
        "source": source.digest,
        "target": target.digest,
        "options": create.options.as_sent(),
        "callback_url": None if create.callback_url is None else str(create.callback_url),
        "callback_events": create.callback_events,
        "deadline_seconds": create.deadline_seconds,
        "queue_timeout_seconds": create.queue_timeout_seconds,
        "priority": priority or create.priority or "normal",
    }
    if extra_sources or references:  # absent otherwise: single-source digests are unchanged
        document["sources"] = [ref.digest for ref in extra_sources]
        document["references"] = [ref.digest for ref in references]
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Submission:
    """One submit request whose inputs are validated and stored."""

    owner: User
    create: JobCreate
    source: InputRef
    target: InputRef
    idempotency_key: str | None = None
    extra_sources: tuple[InputRef, ...] = ()  # a per-face mapping's sources after the first
    references: tuple[InputRef, ...] = ()
    prepared_at: datetime = field(default_factory=utcnow)
    """When the inputs were stored (before the existence check that may skip the upload):
    a retention pass that deleted one of them since then forces a new upload."""

    @property
    def inputs(self) -> tuple[InputRef, ...]:
        """Every input: source, target, a mapping's other sources and references."""
        return (self.source, self.target, *self.extra_sources, *self.references)

    def input_keys(self) -> list[str]:
        """Storage keys of every stored input (URL inputs have none yet)."""
        return [ref.key for ref in self.inputs if ref.key]


@dataclass(frozen=True)
class Admission:
    """What became of one ``Submission``: a new job, an idempotent replay, or an error."""

    job: Job | None
    created: bool = False
    error: ApiError | None = None


def submit_job(
    session: Session,
    *,
    owner: User,
    create: JobCreate,
    source: InputRef,
    target: InputRef,
    settings: Settings,
    idempotency_key: str | None = None,
    extra_sources: Sequence[InputRef] = (),
    references: Sequence[InputRef] = (),
    store: ObjectStore | None = None,
) -> tuple[Job, bool]:
    """Create the job and its dispatch outbox row in one transaction.

    Returns ``(job, created)``: ``created`` is False when ``idempotency_key`` matched an
    earlier job with the same request digest. Raises ``IdempotencyKeyReused`` (409),
    ``QuotaExceeded`` (429), ``Overloaded`` (503) or ``InvalidRequest`` (422).
    """
    submission = Submission(
        owner,
        create,
        source,
        target,
        idempotency_key,
        extra_sources=tuple(extra_sources),
        references=tuple(references),
    )
    (admission,) = submit_jobs(session, submissions=[submission], settings=settings, store=store)
    if admission.error is not None:
        raise admission.error
    assert admission.job is not None
    return admission.job, admission.created


def submit_jobs(
    session: Session,
    *,
    submissions: Sequence[Submission],
    settings: Settings,
    store: ObjectStore | None = None,
) -> list[Admission]:
    """Admit several submissions in one transaction (group commit), in order.

    ``store``: where the inputs are, to look again at an input that a retention pass may
    have deleted since the submit found it stored (``inputs_purged_since``); without it
    such a submission is refused with ``InputsPurged`` (the route stores it again).

    Each is judged as if submitted alone after the ones before it: replays first, then
    the owner's quota and the global backlog, both counting the jobs this batch already
    admitted. Every new job and its dispatch outbox row commit together (invariant 1).
    If the commit hits the idempotency constraint (a concurrent duplicate in another
    transaction), each submission is retried on its own.
    """
    try:
        admissions = _admit(session, submissions, settings, store)
        session.commit()
        return admissions
    except IntegrityError:
        session.rollback()
        if len(submissions) > 1:
            return [
                one
                for submission in submissions
                for one in submit_jobs(
                    session, submissions=[submission], settings=settings, store=store
                )
            ]
        if submissions[0].idempotency_key is None:
            raise
        # A concurrent duplicate committed first: judged again, it is now a replay (or 409).
        admissions = _admit(session, submissions, settings, store)
        session.commit()
        return admissions


@dataclass
class _Batch:
    """What a batch keeps up to date as it admits jobs: the backlog, each owner's
    unfinished jobs, and the idempotency keys it created."""

    load: capacity.Backlog
    active: dict[uuid.UUID, int] = field(default_factory=dict)
    fresh: dict[tuple[uuid.UUID, str], Job] = field(default_factory=dict)


def _admit(
    session: Session,
    submissions: Sequence[Submission],
    settings: Settings,
    store: ObjectStore | None,
) -> list[Admission]:
    serialise_admission(session)
    disabled = {
        owner_id
        for owner_id in sorted({submission.owner.id for submission in submissions})
        if _lock_user(session, owner_id)
    }
    batch = _Batch(capacity.backlog(session, settings=settings))
    purged = inputs_purged_since(
        session,
        keys=[key for submission in submissions for key in submission.input_keys()],
        since=min(s.prepared_at for s in submissions),
    )
    admissions: list[Admission] = []
    with session.no_autoflush:  # new rows are inserted together at commit
        for submission in submissions:
            try:
                if submission.owner.id in disabled:  # its key may still be in a cache
                    raise Unauthorized()
                _check_inputs(submission, purged, store)
                admissions.append(_admit_one(session, submission, batch, settings))
            except ApiError as exc:
                admissions.append(Admission(None, error=exc))
    return admissions


def inputs_purged_since(
    session: Session, *, keys: Sequence[str], since: datetime
) -> dict[str, datetime]:
    """The input keys among ``keys`` that a retention pass may have deleted after ``since``
    (less ``INPUT_PURGE_MARGIN_S``, for clocks that differ), with the newest deletion time.

    A retention pass deletes an input while holding the admission lock and marks the jobs
    it deleted it for (``inputs_purged_at``) in the same transaction; an admission runs
    under the same lock, so it sees every deletion that could have followed its own
    existence check, and looks at those objects again (``_check_inputs``): one that exists
    now stays until this admission commits, since the next pass then sees its job."""
    floor = since - timedelta(seconds=INPUT_PURGE_MARGIN_S)
    found: dict[str, datetime] = {}
    uses = input_key_uses(
        session, keys=keys, where=col(Job.inputs_purged_at) >= floor, value=Job.inputs_purged_at
    )
    for key, at in uses:
        if at is not None:
            found[key] = max(found.get(key, at), at)
    return found


def input_key_uses(
    session: Session, *, keys: Iterable[str], where: Any, value: Any = None
) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` for each job matching ``where`` that uses one of ``keys`` as an
    input: its source, its target, or one of a per-face mapping's other images (kept in
    the ``extra_inputs`` JSON column, so those rows are read and matched here). ``value``
    is a column (or expression) of the job to return with the key; ``None`` without one.
    One piece of logic for the retention pass (what is still in use) and the admission
    (what a pass may just have deleted)."""
    wanted = set(keys)
    if not wanted:
        return
    value = sa.null() if value is None else value
    for column in (Job.source_key, Job.target_key):
        yield from session.exec(  # type: ignore[misc]
            select(column, value).where(col(column).in_(sorted(wanted)), where).distinct()
        ).all()
    mapped = session.exec(
        select(Job.extra_inputs, value).where(col(Job.extra_inputs).is_not(None), where)
    ).all()
    for inputs, at in mapped:
        yield from ((key, at) for key in extra_input_keys(inputs) if key in wanted)


def extra_input_keys(extra_inputs: Mapping[str, Sequence[str]] | None) -> list[str]:
    """The storage keys in a job's ``extra_inputs`` (a mapping's sources and references)."""
    if not extra_inputs:
        return []
    return [key for keys in extra_inputs.values() for key in keys if key]


def missing_inputs(
    keys: Sequence[str],
    purged: Mapping[str, datetime],
    since: datetime,
    store: ObjectStore | None,
) -> list[str]:
    """Of ``keys`` found stored at ``since``, those a retention pass deleted after that
    (``purged``: from ``inputs_purged_since``) and that ``store`` no longer has (all of
    them without a store to look in): they must be stored or fetched again."""
    floor = since - timedelta(seconds=INPUT_PURGE_MARGIN_S)
    return [
        key
        for key in keys
        if (at := purged.get(key)) is not None
        and at >= floor
        and (store is None or not store.exists(key))
    ]


def _check_inputs(
    submission: Submission, purged: Mapping[str, datetime], store: ObjectStore | None
) -> None:
    if missing_inputs(submission.input_keys(), purged, submission.prepared_at, store):
        raise InputsPurged(retry_after=1)


def _admit_one(
    session: Session, submission: Submission, batch: _Batch, settings: Settings
) -> Admission:
    create, owner, key = submission.create, submission.owner, submission.idempotency_key
    target = submission.target
    video = target.media == "video" or (target.url is not None and looks_like_video(target.url))
    deadline_s, queue_s = _timeouts(create, settings, video=video)
    lane = job_lane(create, owner)
    digest = request_digest(
        create,
        submission.source,
        submission.target,
        submission.extra_sources,
        submission.references,
        lane,
    )
    if key is not None:
        existing = batch.fresh.get((owner.id, key)) or _by_idempotency_key(
            session, owner_id=owner.id, key=key
        )
        if existing is not None:
            return Admission(_replay(existing, digest))
    if owner.id not in batch.active:
        batch.active[owner.id] = capacity.count_active(session, owner=owner)
    capacity.check_capacity(
        active=batch.active[owner.id],
        owner=owner,
        load=batch.load,
        lane=lane,
        queue_timeout_s=queue_s,
        settings=settings,
        video=video,
    )
    job = _new_job(submission, digest, lane, deadline_s, queue_s, settings)
    session.add(job)
    session.add(
        Outbox(
            kind="dispatch",
            job_id=job.id,
            payload={"attempt": 1},
            created_at=job.created_at,
            next_attempt_at=job.created_at,
        )
    )
    frames = capacity.video_frames(target.video) if video else None
    batch.load = batch.load.admitted(lane, video_frames=frames)
    batch.active[owner.id] += 1
    if key is not None:
        batch.fresh[(owner.id, key)] = job
    return Admission(job, created=True)


def job_lane(create: JobCreate, owner: User) -> Priority:
    """The lane of a new job: the request's priority, else the key's priority class.
    Only a key of the high class may ask for ``high`` (``PriorityNotAllowed``, 403)."""
    lane = create.priority or owner.priority
    if lane == "high" and owner.priority != "high":
        raise PriorityNotAllowed()
    return lane


def _new_job(
    submission: Submission,
    digest: str,
    lane: Priority,
    deadline_s: int,
    queue_s: int,
    settings: Settings,
) -> Job:
    create, source, target = submission.create, submission.source, submission.target
    owner = submission.owner
    now = utcnow()
    callback_events = (
        list(create.callback_events or DEFAULT_CALLBACK_EVENTS) if create.callback_url else []
    )
    return Job(
        owner_id=submission.owner.id,
        idempotency_key=submission.idempotency_key,
        input_digest=digest,
        source_key=source.key,
        target_key=target.key,
        source_url=source.url,
        target_url=target.url,
        extra_inputs=(
            {
                "sources": [str(ref.key) for ref in submission.extra_sources],
                "references": [str(ref.key) for ref in submission.references],
            }
            if submission.extra_sources or submission.references
            else None
        ),
        input_pixels=job_pixels(submission.inputs, settings.image_limits),
        media=target.media,
        video_input=target.video,
        options=create.options.as_sent(),
        priority=lane,
        input_retention_s=_or(owner.input_retention_s, settings.input_retention_seconds),
        result_retention_s=_or(owner.result_retention_s, settings.result_retention_seconds),
        callback_url=None if create.callback_url is None else str(create.callback_url),
        callback_events=callback_events,
        max_attempts=settings.max_attempts,
        created_at=now,
        updated_at=now,
        deadline_at=now + timedelta(seconds=deadline_s),
        queue_deadline_at=now + timedelta(seconds=min(queue_s, deadline_s)),
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _timeouts(create: JobCreate, settings: Settings, *, video: bool) -> tuple[int, int]:
    """The job's deadline and queue timeout: the request's, else the settings' defaults
    (a video job's own: a video target, or a target URL whose path names a video file);
    ``InvalidRequest`` beyond the maxima."""
    if video:
        default_s, max_s = (
            settings.default_video_deadline_seconds,
            settings.max_video_deadline_seconds,
        )
    else:
        default_s, max_s = settings.default_deadline_seconds, settings.max_deadline_seconds
    deadline_s = create.deadline_seconds or default_s
    queue_s = create.queue_timeout_seconds or settings.default_queue_timeout_seconds
    if deadline_s > max_s:
        raise InvalidRequest(f"deadline_seconds must be at most {max_s}.")
    if queue_s > settings.max_queue_timeout_seconds:
        raise InvalidRequest(
            f"queue_timeout_seconds must be at most {settings.max_queue_timeout_seconds}."
        )
    return deadline_s, queue_s


def _lock_user(session: Session, user_id: uuid.UUID) -> bool:
    """Order one user's concurrent submits (PostgreSQL row lock; SQLite transactions are
    ``BEGIN IMMEDIATE``, so already serial) and return whether the user is disabled (or
    gone): read under the lock, so no job is admitted after ``disable_user``'s sweep."""
    statement = select(User.disabled).where(col(User.id) == user_id)
    if session.get_bind().dialect.name != "sqlite":
        statement = statement.with_for_update()
    disabled = session.exec(statement).first()
    return disabled is None or bool(disabled)


def _by_idempotency_key(session: Session, *, owner_id: uuid.UUID, key: str) -> Job | None:
    return session.exec(
        select(Job).where(col(Job.owner_id) == owner_id, col(Job.idempotency_key) == key)
    ).first()


def _replay(existing: Job, digest: str) -> Job:
    if existing.input_digest != digest:
        raise IdempotencyKeyReused()
    return existing


# --------------------------------------------------------------------------- admission lock


#: PostgreSQL advisory-lock key that serialises the backlog check with the insert.
BACKLOG_LOCK_KEY = 0x46414345  # "FACE"


def serialise_admission(session: Session) -> None:
    """Hold a transaction-scoped lock around the global backlog check and the insert.

    The user-row lock only orders one user's submits; without this, a burst from many
    users on PostgreSQL all counted the same backlog and were all admitted past it.
    SQLite transactions are ``BEGIN IMMEDIATE``: already serial.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.exec(select(sa.func.pg_advisory_xact_lock(BACKLOG_LOCK_KEY))).first()


# --------------------------------------------------------------------------- reading


def get_job(session: Session, *, owner: User, job_id: uuid.UUID) -> Job:
    """The caller's job; another user's job is ``NotFound`` like a missing one."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.owner_id != owner.id:
        raise NotFound()
    return job


def list_jobs(
    session: Session,
    *,
    owner: User,
    status: JobStatus | None = None,
    limit: int = 20,
    cursor: str | None = None,
) -> tuple[list[Job], str | None]:
    """A page of the caller's jobs, newest first, and the cursor of the next page."""
    limit = max(1, min(limit, MAX_PAGE))
    query = select(Job).where(col(Job.owner_id) == owner.id)
    if status is not None:
        query = query.where(col(Job.status) == status)
    if cursor:
        created, last_id = decode_cursor(cursor)
        query = query.where(
            sa.or_(
                col(Job.created_at) < created,
                sa.and_(col(Job.created_at) == created, col(Job.id) < last_id),
            )
        )
    rows = list(
        session.exec(
            query.order_by(col(Job.created_at).desc(), col(Job.id).desc()).limit(limit + 1)
        )
    )
    page, more = rows[:limit], len(rows) > limit
    return page, encode_cursor(page[-1]) if more and page else None


def encode_cursor(job: Job) -> str:
    """An opaque cursor pointing after ``job``."""
    raw = f"{job.created_at.isoformat()}|{job.id.hex}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """The (created_at, id) in a cursor; ``InvalidRequest`` if it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, _, job_id = raw.partition("|")
        value = datetime.fromisoformat(created), uuid.UUID(hex=job_id)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("cursor: not a cursor returned by this API.") from exc
    if value[0].tzinfo is None:
        raise InvalidRequest("cursor: not a cursor returned by this API.")
    return value


def callbacks_for(
    session: Session, *, job_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, list[WebhookDelivery]]:
    """Webhook delivery attempts of each job, oldest first."""
    found: dict[uuid.UUID, list[WebhookDelivery]] = defaultdict(list)
    if not job_ids:
        return found
    rows = session.exec(
        select(WebhookDelivery)
        .where(col(WebhookDelivery.job_id).in_(list(job_ids)))
        .order_by(col(WebhookDelivery.at), col(WebhookDelivery.attempt))
    )
    for delivery in rows:
        found[delivery.job_id].append(delivery)
    return found


def job_status(session: Session, *, job_id: uuid.UUID) -> JobStatus | None:
    """Just the status of a job (cheap poll for ``Prefer: wait``)."""
    value = session.exec(select(Job.status).where(col(Job.id) == job_id)).first()
    return None if value is None else JobStatus(value)


def oldest_queued(session: Session) -> dict[str, datetime]:
    """When the oldest queued job of each lane was created (lanes with none are absent)."""
    rows = session.exec(
        select(Job.priority, sa.func.min(Job.created_at))
        .where(col(Job.status) == JobStatus.queued)
        .group_by(col(Job.priority))
    ).all()
    return {lane: created for lane, created in rows if created is not None}


def status_counts(session: Session) -> dict[JobStatus, int]:
    """How many jobs are in each status (every status present, zeros included)."""
    counts: dict[JobStatus, int] = dict.fromkeys(JobStatus, 0)
    rows = session.exec(select(Job.status, sa.func.count()).group_by(col(Job.status))).all()
    for status, count in rows:
        counts[JobStatus(status)] = int(count)
    return counts


# --------------------------------------------------------------------------- cancel


#: How many times a cancel looks again after losing a race with the relay.
CANCEL_TRIES = 5
USER_DISABLED_MESSAGE = "The job was cancelled: its user was disabled."
#: What a cancel moves a job to, by the status it was seen in.
_CANCELLED_TO = {
    JobStatus.queued: JobStatus.cancelled,
    JobStatus.running: JobStatus.cancel_requested,
}


def cancel_job(session: Session, *, owner: User, job_id: uuid.UUID) -> Job:
    """Cancel the caller's job: queued → cancelled now (its dispatch made obsolete);
    running → cancel_requested (the relay cancels the flow run); cancel_requested stays.
    A finished job raises ``JobNotCancellable`` (409)."""
    for _ in range(CANCEL_TRIES):
        job = get_job(session, owner=owner, job_id=job_id)
        status = job.status
        if status.is_terminal:
            raise JobNotCancellable(f"The job is already {status.value}.")
        if status is JobStatus.cancel_requested:
            session.commit()
            return job
        if _cancel(session, job_id=job_id, status=status, message="The job was cancelled."):
            return get_job(session, owner=owner, job_id=job_id)
        session.rollback()  # lost a race with the relay: look again
    raise JobNotCancellable("The job changed state repeatedly; try again.")


def cancel_jobs_of(session: Session, *, owner_id: uuid.UUID, message: str) -> dict[JobStatus, int]:
    """Cancel every queued or running job of a user as ``cancel_job`` does (a lost race
    is looked at again); commits. Returns how many became cancelled / cancel_requested."""
    counts = dict.fromkeys((JobStatus.cancelled, JobStatus.cancel_requested), 0)
    for _ in range(CANCEL_TRIES):
        jobs = session.exec(
            select(Job.id, Job.status).where(
                col(Job.owner_id) == owner_id,
                col(Job.status).in_([JobStatus.queued, JobStatus.running]),
            )
        ).all()
        session.commit()  # ends the read (each cancel below commits on its own)
        if not jobs:
            break
        for job_id, seen in jobs:
            status = JobStatus(seen)
            if _cancel(session, job_id=job_id, status=status, message=message):
                counts[_CANCELLED_TO[status]] += 1
    return counts


def _cancel(session: Session, *, job_id: uuid.UUID, status: JobStatus, message: str) -> bool:
    """One compare-and-set cancel of a job last seen ``status`` (queued or running)."""
    fields: dict[str, Any] = {}
    if status is JobStatus.queued:
        fields = {"error_code": JobErrorCode.cancelled, "error_message": message}
    return transition(session, job_id=job_id, to=_CANCELLED_TO[status], expected=status, **fields)
