"""The results database: SQLAlchemy models and engine/session helpers, Postgres or SQLite.

Tables:
    ``batches``             one row per submitted batch: status lifecycle and job counts.
    ``jobs``                one row per request, keyed by job id: the request, its status and result.
    ``product_enrichment``  one row per (catalog, product id): predicted category and written description.
    ``dead_letters``        one row per queue message the worker could not read, with the reason.

Views for services downstream (``latest_enrichment``, ``batch_summary``, ``failed_jobs``), the
``weir_batch`` notification channel and the ``weir_reader`` role are made by migration
``20261202_0007``; ``docs/downstream.md`` is their contract.

The schema itself is created by the Alembic migrations in ``migrations/``; the models here must
match them (``tests/jobs/test_migrations.py`` compares the two).
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import (
    JSON,
    DateTime,
    Engine,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    create_engine,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SQLITE_BUSY_TIMEOUT_MS = 30_000


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what every timestamp column stores)."""
    return datetime.now(timezone.utc)


class BatchStatus(str, enum.Enum):
    """A batch's lifecycle: ``validating -> queued -> in_progress -> completed | failed | cancelled``
    (OpenAI's batch lifecycle).

    ``validating``: the client is still storing its jobs; nothing is published and no worker runs
    them. ``completed``: every job finished and at least one succeeded. ``failed``: every job failed.
    """

    VALIDATING = "validating"
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_BATCH


_FINISHED_BATCH = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED})


class JobStatus(str, enum.Enum):
    """A job's lifecycle: ``queued -> running -> succeeded | failed``, or ``cancelled`` from
    ``queued`` or ``running``.

    A finished job (the last three) is never run again; ``succeeded`` and ``cancelled`` are never
    overwritten.
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_JOB_STATUSES


FINISHED_JOB_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class JobKind(str, enum.Enum):
    GENERATE = "generate"
    CLASSIFY = "classify"


def _enum_column(enum_cls: type[enum.Enum], name: str) -> Enum:
    # VARCHAR plus a named CHECK constraint: portable, and new members need only a migration of the
    # constraint, not of a native Postgres type.
    return Enum(
        enum_cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda members: [m.value for m in members],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        # SQL NULL, not JSON 'null', for a missing value.
        dict[str, Any]: JSON(none_as_null=True),
        uuid.UUID: Uuid,
        datetime: DateTime(timezone=True),
    }


class Batch(Base):
    """One submitted batch.

    Invariant: ``num_succeeded + num_failed + num_cancelled <= num_jobs``, equal once the batch is
    finished. The counters move by the number of real job transitions in the same transaction as
    those transitions (never a recount under a lock); ``weir.jobs.counters.reconcile_batches`` recounts
    and repairs. ``idempotency_key`` (unique, optional): a second batch with the same key is never
    created (the nightly enrichment's catalog and scheduled slot).
    """

    __tablename__ = "batches"
    __table_args__ = (
        # Recent batches first (``batch_summary``, docs/downstream.md).
        Index("ix_batches_created_at", "created_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    status: Mapped[BatchStatus] = mapped_column(
        _enum_column(BatchStatus, "batch_status"), default=BatchStatus.QUEUED
    )
    model: Mapped[str] = mapped_column(String(200))
    num_jobs: Mapped[int] = mapped_column(Integer, default=0)
    num_succeeded: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    num_cancelled: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[Optional[datetime]]
    finished_at: Mapped[Optional[datetime]]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    idempotency_key: Mapped[Optional[str]] = mapped_column(String(300), unique=True)


class Job(Base):
    """One request and its result. ``custom_id`` is the caller's id, unique within its batch.

    ``batch_index`` is the request's position in the batch (results come back in submission order).
    ``attempts`` counts the times a worker started it; ``worker`` and ``claimed_at`` are the latest
    start's (a start cut short by an engine failure, not the job's fault, is given back). A claim
    is a lease: ``worker`` holds the job until ``lease_expires_at`` (renewed while it runs), and
    ``lease_token``, one more with every claim, is its fencing token: a write carrying an older
    token changes nothing. ``published_at`` is when its message was last published (null: not
    yet). Result columns stay null until it finishes.

    A generation's result: ``output_text``/``finish_reason`` are its first completion's (the
    only one for ``n == 1``); ``completions`` holds all ``n`` of them, in order, as
    ``{"index", "text", "finish_reason", "stop_reason", "num_tokens", "cumulative_logprob",
    "logprobs", "parsed"}`` (``logprobs``: null unless asked, else per generated token a list of
    ``{"token_id", "logprob", "rank", "decoded_token"}``, the sampled token first, then the top
    ones); ``num_completion_tokens`` counts the tokens of all of them (OpenAI's usage);
    ``prompt_logprobs`` the same entries per prompt token (null for the first) when asked.
    ``parsed`` is the first completion's text parsed as JSON, set only when the job asked for
    JSON output (``response_format`` or a ``json``/``json_object`` constraint), it finished as
    ``stop`` and its text parses; null otherwise (an output cut by ``max_tokens`` is never
    claimed valid, and a JSON ``null`` reads as null too).
    """

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        # Results in submission order.
        UniqueConstraint("batch_id", "batch_index"),
        # Batch counts are recomputed from this index alone.
        Index("ix_jobs_batch_id_status", "batch_id", "status"),
        # The sweeper's scan: unfinished jobs by the time of their last publish.
        Index("ix_jobs_status_published_at", "status", "published_at"),
        # The sweeper's scan for expired leases.
        Index("ix_jobs_status_lease_expires_at", "status", "lease_expires_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    batch_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    batch_index: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[JobKind] = mapped_column(_enum_column(JobKind, "job_kind"))
    model: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict[str, Any]]
    status: Mapped[JobStatus] = mapped_column(
        _enum_column(JobStatus, "job_status"), default=JobStatus.QUEUED
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    output_text: Mapped[Optional[str]] = mapped_column(Text)
    label: Mapped[Optional[str]] = mapped_column(Text)
    label_probs: Mapped[Optional[dict[str, Any]]]
    finish_reason: Mapped[Optional[str]] = mapped_column(String(16))
    completions: Mapped[Optional[list[Any]]] = mapped_column(JSON(none_as_null=True))
    parsed: Mapped[Optional[Any]] = mapped_column(JSON(none_as_null=True))
    prompt_logprobs: Mapped[Optional[list[Any]]] = mapped_column(JSON(none_as_null=True))
    num_prompt_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    num_completion_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    num_cached_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    queued_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[Optional[datetime]]
    finished_at: Mapped[Optional[datetime]]
    error: Mapped[Optional[str]] = mapped_column(Text)
    worker: Mapped[Optional[str]] = mapped_column(String(200))
    claimed_at: Mapped[Optional[datetime]]
    lease_expires_at: Mapped[Optional[datetime]]
    lease_token: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    published_at: Mapped[Optional[datetime]]


class DeadLetter(Base):
    """A queue message the worker could not read (not weir's schema), kept with the reason.

    ``body`` is the message body as received (decoded as UTF-8 with replacement, at most
    :data:`MAX_DEAD_LETTER_BODY_CHARS` characters).
    """

    __tablename__ = "dead_letters"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    queue: Mapped[Optional[str]] = mapped_column(String(200))
    task: Mapped[Optional[str]] = mapped_column(String(200))
    message_id: Mapped[Optional[str]] = mapped_column(String(200))
    body: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)


MAX_DEAD_LETTER_BODY_CHARS = 65_536


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, connection_record):
        # Take transaction control from the sqlite3 module so that BEGIN IMMEDIATE below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL lets readers (the client polling a batch) run beside the writing task threads.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        # A deferred transaction that reads and then writes fails at once with SQLITE_BUSY when
        # another writer committed in between, whatever busy_timeout says; taking the write lock
        # at BEGIN makes concurrent writers queue on busy_timeout instead.
        connection.exec_driver_sql("BEGIN IMMEDIATE")


DEFAULT_POOL_SIZE = 5


def make_engine(
    url: str,
    *,
    connect_timeout_s: int = 5,
    statement_timeout_s: float = 30.0,
    lock_timeout_s: float = 10.0,
    pool_size: Optional[int] = None,
    pool_timeout_s: float = 30.0,
    **kwargs: Any,
) -> Engine:
    """Create a SQLAlchemy engine for ``url`` (``postgresql+psycopg://...`` or ``sqlite:///path``).

    A bare ``postgresql://`` URL is read as psycopg 3. Postgres connections get a connect timeout,
    ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout`` (twice the
    statement timeout), and TCP keepalives (idle 10 s, then every 5 s, 3 probes) with a 30 s TCP
    user timeout, so a database that vanishes fails a call within about those times instead of
    hanging a thread. A database that keeps the connection open but never answers (a stuck proxy)
    is caught by :func:`watchdog`. The pool keeps ``pool_size`` connections (default
    ``DEFAULT_POOL_SIZE``: a worker's task threads never touch the database themselves; its writes
    go through one group-commit thread, plus the lease renewer, dead letters and control tasks)
    with as many again as overflow; waiting for one longer than ``pool_timeout_s`` raises
    ``sqlalchemy.exc.TimeoutError``, which workers treat as transient.
    SQLite connections run in WAL mode with a busy timeout and ``BEGIN IMMEDIATE`` transactions,
    so many task threads can write one file.

    Args:
        url: database URL.
        kwargs: passed on to ``sqlalchemy.create_engine``.
    """
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith("sqlite"):
        engine = create_engine(url, **kwargs)
        _configure_sqlite(engine)
        return engine
    statement_ms, lock_ms = int(statement_timeout_s * 1000), int(lock_timeout_s * 1000)
    connect_args = dict(
        connect_timeout=connect_timeout_s,
        keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
        tcp_user_timeout=30_000,
        options=(f"-c statement_timeout={statement_ms} -c lock_timeout={lock_ms} "
                 f"-c idle_in_transaction_session_timeout={2 * statement_ms}"),
    )
    connect_args.update(kwargs.pop("connect_args", {}))
    size = pool_size or DEFAULT_POOL_SIZE
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", size)
    kwargs.setdefault("max_overflow", size)
    kwargs.setdefault("pool_timeout", pool_timeout_s)
    return create_engine(url, connect_args=connect_args, **kwargs)


def engine_for(settings: Any, **kwargs: Any) -> Engine:
    """:func:`make_engine` for a ``weir.config.DatabaseSettings`` (its URL, timeouts, pool size)."""
    return make_engine(
        settings.url(), connect_timeout_s=settings.connect_timeout_s,
        statement_timeout_s=settings.statement_timeout_s, lock_timeout_s=settings.lock_timeout_s,
        pool_size=settings.pool_size, pool_timeout_s=settings.pool_timeout_s, **kwargs,
    )


class watchdog:
    """Shut down a session's database socket if the block runs longer than ``timeout_s``.

    For a database that keeps the TCP connection open but never answers (a stuck proxy or a
    frozen host behind one): no server-side timeout can fire and the kernel sees its bytes
    acknowledged, so the call would block forever. Shutting the socket down makes the blocked call
    fail at once with a lost-connection ``OperationalError`` (transient: the caller retries on a
    new connection). A no-op on SQLite.

    Usage::

        with session_factory.begin() as session, watchdog(session, 40.0):
            ...
    """

    def __init__(self, session: Any, timeout_s: float) -> None:
        self._session, self._timeout_s = session, timeout_s
        self._timer: Optional[Any] = None
        self.fired = False

    def __enter__(self) -> "watchdog":
        import threading

        if self._session.get_bind().dialect.name == "postgresql":
            fd = self._session.connection().connection.dbapi_connection.pgconn.socket
            self._timer = threading.Timer(self._timeout_s, self._shut, args=(fd,))
            self._timer.daemon = True
            self._timer.start()
        return self

    def _shut(self, fd: int) -> None:
        import os
        import socket

        self.fired = True
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()


def make_session_factory(engine: Engine) -> sessionmaker:
    """A ``sessionmaker`` bound to ``engine``; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
