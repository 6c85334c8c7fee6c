"""Reads and writes of batches and jobs. Callers own the session and transaction (an
application's own rows, such as the catalog's, are written by its result projection inside the
same transaction as the results: :data:`weir.jobs.applications.RESULT_PROJECTIONS`).

Concurrency rules (the cost of each is constant, whatever the batch's size):

- A job changes state only through guarded transitions (``UPDATE .. WHERE status = ..``):
  claim ``queued -> running`` (or ``running`` under an expired lease), finish ``running ->
  succeeded | failed`` under the claim's fencing token, cancel ``queued | running ->
  cancelled``. Concurrent writers of one job serialize on its row, and only a real transition
  reports a row back.
- Each real transition moves its batch's counters by one in the same transaction (one
  ``UPDATE batches SET num_x = num_x + k`` per batch per transaction, last before the commit):
  the counters never drift and never need a recount, and the transaction that brings them to
  ``num_jobs`` finishes the batch, exactly once. Claims never lock the batch row.
  :func:`reconcile_batches` recounts from ``jobs`` and repairs (the rare check).

Result writes are upserts keyed by job id (``INSERT .. ON CONFLICT (id) DO UPDATE .. WHERE``):
a redelivered job never makes a second row, and a finished job is never changed again.

Storage rules for results (the same on Postgres and SQLite): a NUL character (U+0000) in any text
result (generated text, label, error, and every string inside ``completions``, ``parsed`` and
``prompt_logprobs``) is stored as U+FFFD, since Postgres text cannot hold NUL; nothing else
changes and nothing is cut. NaN and Infinity in ``label_probs`` and inside the JSON results (and a
non-finite ``category_confidence``) are stored as null.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Optional, Sequence

from sqlalchemy import and_, case, delete, func, insert, or_, select, text, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from weir.jobs.db import (
    MAX_DEAD_LETTER_BODY_CHARS,
    Batch,
    BatchStatus,
    DeadLetter,
    Job,
    JobKind,
    JobStatus,
    utcnow,
)
from weir.jobs.schemas import JobRequest, check_json

NUL_REPLACEMENT = "\ufffd"
"""What a NUL character in a text result is stored as (Postgres text cannot hold U+0000)."""


@dataclass
class JobResult:
    """The outcome of running one job, as the worker hands it to :func:`record_result`.

    ``status`` is ``SUCCEEDED`` or ``FAILED``; a failure carries ``error`` and no output.
    ``label_probs`` maps each label to its probability (summing to 1). ``completions``,
    ``parsed`` and ``prompt_logprobs`` are a generation's, as :class:`weir.jobs.db.Job` describes.
    """

    status: JobStatus
    output_text: Optional[str] = None
    label: Optional[str] = None
    label_probs: Optional[dict[str, float]] = None
    finish_reason: Optional[str] = None
    completions: Optional[list[dict[str, Any]]] = None
    parsed: Any = None
    prompt_logprobs: Optional[list[Any]] = None
    num_prompt_tokens: Optional[int] = None
    num_completion_tokens: Optional[int] = None
    num_cached_tokens: Optional[int] = None
    error: Optional[str] = None

    @classmethod
    def failure(cls, error: str) -> "JobResult":
        return cls(status=JobStatus.FAILED, error=error)

    def storable(self) -> "JobResult":
        """This result under the module's storage rules: NUL -> U+FFFD in text, NaN/Inf -> None."""
        probs = None
        if self.label_probs is not None:
            probs = {_text(k): (v if math.isfinite(v) else None) for k, v in self.label_probs.items()}
        return replace(
            self,
            output_text=_text(self.output_text),
            label=_text(self.label),
            label_probs=probs,
            finish_reason=_text(self.finish_reason),
            completions=_json_value(self.completions),
            parsed=_json_value(self.parsed),
            prompt_logprobs=_json_value(self.prompt_logprobs),
            error=_text(self.error),
        )


def parse_json_output(text: str, finish_reason: Optional[str]) -> Any:
    """The JSON value of a generated text that was asked to be JSON, or None.

    None unless the generation finished as ``"stop"`` (an output cut by ``max_tokens`` or
    ``max_model_len`` is never claimed valid) and the whole text (surrounding whitespace aside) is
    one JSON value that the database can store: NaN and Infinity, which Python's parser accepts,
    are not JSON.
    """
    if finish_reason != "stop":
        return None
    try:
        value = json.loads(text, parse_constant=_not_json)
        check_json(value, "output")
    except ValueError:  # json.JSONDecodeError is one
        return None
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _text(value: Optional[str]) -> Optional[str]:
    return None if value is None else value.replace("\x00", NUL_REPLACEMENT)


def _json_value(value: Any) -> Any:
    """``value`` under the storage rules: NUL -> U+FFFD in every string, NaN/Inf -> None."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {_text(str(k)): _json_value(v) for k, v in value.items()}
    return value


def create_batch(
    session: Session,
    requests: Sequence[JobRequest],
    *,
    model: str,
    metadata: Optional[dict[str, Any]] = None,
) -> tuple[Batch, list[Job]]:
    """Add a queued batch and one queued job per request in this session (flushed, not committed).

    The small-batch form of what :meth:`weir.jobs.client.Client.enqueue_batch` does chunk by chunk:
    :func:`begin_batch`, :func:`add_jobs`, :func:`queue_batch`.

    Args:
        requests: validated requests; a request without ``custom_id`` gets its position as one.
        model: the model name the jobs are for (also the queue they go to).
        metadata: free JSON kept on the batch.

    Returns:
        The batch and its jobs in request order.

    Raises:
        ValueError: two requests share a ``custom_id``, or ``metadata`` is not plain JSON (the
            message names the field, see :func:`weir.jobs.schemas.check_json`).
    """
    batch = begin_batch(session, model=model, metadata=metadata)
    add_jobs(session, batch.id, requests, first_index=0, model=model, published_at=utcnow())
    queue_batch(session, batch.id, len(requests))
    return batch, list_jobs(session, batch.id)


def begin_batch(
    session: Session,
    *,
    model: str,
    metadata: Optional[dict[str, Any]] = None,
    idempotency_key: Optional[str] = None,
) -> Batch:
    """Add a ``validating`` batch with no jobs yet (flushed, not committed).

    No worker claims and no sweeper publishes a job of a ``validating`` batch.

    Raises:
        ValueError: ``metadata`` is not plain JSON (see :func:`weir.jobs.schemas.check_json`).
        sqlalchemy.exc.IntegrityError: a batch with ``idempotency_key`` exists (at the flush).
    """
    check_json(dict(metadata or {}), "batch metadata")
    batch = Batch(
        model=model, status=BatchStatus.VALIDATING, num_jobs=0, meta=dict(metadata or {}),
        idempotency_key=idempotency_key,
    )
    session.add(batch)
    session.flush()
    return batch


def batch_with_key(session: Session, idempotency_key: str) -> Optional[Batch]:
    """The batch created with ``idempotency_key``, if any."""
    return session.scalar(select(Batch).where(Batch.idempotency_key == idempotency_key))


# Columns left out take their server default: a NOT NULL column with only a Python-side default
# must be listed here (COPY does not run SQLAlchemy's defaults).
_JOB_COPY_COLUMNS = (
    "id", "batch_id", "batch_index", "custom_id", "kind", "model", "request", "status", "attempts",
    "queued_at", "published_at",
)


def add_jobs(
    session: Session,
    batch_id: uuid.UUID,
    requests: Sequence[JobRequest],
    *,
    first_index: int,
    model: str,
    published_at: Optional[datetime],
) -> None:
    """Insert one ``queued`` job per request, at batch indexes ``first_index, first_index + 1, ...``.

    One ``COPY`` on Postgres (about 25,000 rows/s on 2 cores), one ``executemany`` on SQLite,
    inside a savepoint: on a duplicate ``custom_id`` nothing of this call is kept and the rest of
    the transaction stands.

    Args:
        requests: validated requests; one without ``custom_id`` gets its batch index as one.
        published_at: stored as the jobs' ``published_at`` (when their message is about to be
            published; None: not yet).

    Raises:
        ValueError: a ``custom_id`` appears twice among ``requests`` or is already one of the
            batch's (the message names it and its batch index).
    """
    custom_ids = [r.custom_id if r.custom_id is not None else str(first_index + i) for i, r in enumerate(requests)]
    seen: set[str] = set()
    for i, custom_id in enumerate(custom_ids):
        if custom_id in seen:
            raise _duplicate(custom_id, first_index + i)
        seen.add(custom_id)
    now = utcnow()
    dialect = session.get_bind().dialect
    try:
        with session.begin_nested():
            if dialect.name == "postgresql":
                _copy_jobs(session, batch_id, requests, custom_ids, first_index, model, now, published_at)
            else:
                rows = [
                    dict(id=uuid.uuid4(), batch_id=batch_id, batch_index=first_index + i, custom_id=custom_id,
                         kind=JobKind(request.kind), model=model,
                         request=request.model_dump(mode="json", exclude_none=True),
                         status=JobStatus.QUEUED, attempts=0, queued_at=now, published_at=published_at)
                    for i, (request, custom_id) in enumerate(zip(requests, custom_ids))
                ]
                session.connection().execute(insert(Job), rows)
    except (IntegrityError, dialect.dbapi.IntegrityError):
        for start in range(0, len(custom_ids), _MAX_IN_PARAMS):  # the first request whose id is taken
            part = custom_ids[start:start + _MAX_IN_PARAMS]
            taken = set(session.scalars(
                select(Job.custom_id).where(Job.batch_id == batch_id, Job.custom_id.in_(part))
            ))
            for i, custom_id in enumerate(part):
                if custom_id in taken:
                    raise _duplicate(custom_id, first_index + start + i) from None
        raise


_MAX_IN_PARAMS = 1000


def _copy_jobs(session, batch_id, requests, custom_ids, first_index, model, now, published_at) -> None:
    cursor = session.connection().connection.dbapi_connection.cursor()
    try:
        with cursor.copy(f"COPY {Job.__tablename__} ({', '.join(_JOB_COPY_COLUMNS)}) FROM STDIN") as copy:
            for i, (request, custom_id) in enumerate(zip(requests, custom_ids)):
                copy.write_row((
                    uuid.uuid4(), batch_id, first_index + i, custom_id, request.kind, model,
                    json.dumps(request.model_dump(mode="json", exclude_none=True)),
                    JobStatus.QUEUED.value, 0, now, published_at,
                ))
    finally:
        cursor.close()


def _duplicate(custom_id: str, index: int) -> ValueError:
    return ValueError(f"custom_id {custom_id!r} appears more than once in the batch (batch index {index})")


def queue_batch(session: Session, batch_id: uuid.UUID, num_jobs: int) -> None:
    """End a batch's ``validating``: set its ``num_jobs`` and make it ``queued`` (not committed).

    Raises:
        LookupError: no ``validating`` batch has this id.
    """
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
        .values(status=BatchStatus.QUEUED, num_jobs=num_jobs)
        .execution_options(synchronize_session="fetch")
    )
    if result.rowcount != 1:
        raise LookupError(f"no validating batch with id {batch_id}")


def analyze_jobs(session: Session) -> bool:
    """Refresh PostgreSQL's planner statistics of the ``jobs`` table (``ANALYZE``: a sample of
    at most 30,000 rows by default, whatever the table's size); True when it ran, False on
    another database (SQLite plans these statements by the primary key anyway).

    After a bulk insert (PostgreSQL's "Populating a Database": run ANALYZE afterwards), the
    statistics still describe the table without the new rows until autovacuum catches up (a
    minute or more); meanwhile the planner, believing few jobs ``queued``, scans the status index
    for the claim statement's ``status = 'queued'`` and filters by id, reading every queued job
    of every batch for each claim.
    """
    if session.get_bind().dialect.name != "postgresql":
        return False
    session.execute(text("ANALYZE jobs"))
    return True


def delete_batch(session: Session, batch_id: uuid.UUID) -> None:
    """Delete a batch and (by ``ON DELETE CASCADE``) its jobs (not committed); no such batch is a no-op."""
    session.execute(delete(Batch).where(Batch.id == batch_id).execution_options(synchronize_session=False))


def delete_stale_validating(session: Session, *, created_before: datetime) -> list[uuid.UUID]:
    """Delete the ``validating`` batches created before ``created_before`` with their jobs (not
    committed): their producer died while storing them, nothing of them was published, and each
    would otherwise hold its ``idempotency_key`` for good (a nightly run's retry would find the
    key taken and enqueue nothing).

    Returns:
        The ids deleted.
    """
    stale = list(session.execute(
        select(Batch.id).where(Batch.status == BatchStatus.VALIDATING, Batch.created_at < created_before)
        .with_for_update(skip_locked=True)
    ).scalars())
    if stale:
        session.execute(delete(Batch).where(Batch.id.in_(stale)).execution_options(synchronize_session=False))
    return stale


def stamp_published(
    session: Session, batch_id: uuid.UUID, first_index: int, num_jobs: int, when: Optional[datetime]
) -> list[uuid.UUID]:
    """Set ``published_at`` to ``when`` for the batch's jobs of batch index ``first_index`` to
    ``first_index + num_jobs - 1`` (not committed); the batch is published page by page this way.

    Returns:
        Their ids in batch-index order.
    """
    stmt = (
        update(Job)
        .where(Job.batch_id == batch_id, Job.batch_index >= first_index, Job.batch_index < first_index + num_jobs)
        .values(published_at=when)
        .returning(Job.batch_index, Job.id)
        .execution_options(synchronize_session=False)
    )
    return [job_id for _, job_id in sorted(session.execute(stmt).all())]


class ClaimStatus(str, enum.Enum):
    """What a claim found (see :func:`claim_jobs`)."""

    CLAIMED = "claimed"
    """This caller now holds the job's lease and should run it."""
    HELD = "held"
    """Another claim's lease is live: the job runs elsewhere (a duplicate delivery)."""
    FINISHED = "finished"
    """The job is succeeded, failed or cancelled: nothing to do."""
    GAVE_UP = "gave_up"
    """The job had been started ``max_attempts`` times; it is now ``failed`` with the reason."""
    UNKNOWN = "unknown"
    """No such job (or its batch is still ``validating``)."""


@dataclass(frozen=True)
class Claim:
    """One job's claim. ``job`` (CLAIMED only) is the row as claimed; its ``lease_token`` is the
    lease's fencing token. ``lease_expires_at`` (CLAIMED and HELD) is when the lease runs out."""

    status: ClaimStatus
    job: Optional[Job] = None
    lease_expires_at: Optional[datetime] = None


_jobs = Job.__table__
_batches = Batch.__table__
# The hot statements below are Core statements on the tables (compiled once and cached), not ORM
# bulk operations, whose per-row bookkeeping costs more than the database work.


def _not_validating():
    return _jobs.c.batch_id.in_(select(_batches.c.id).where(_batches.c.status != BatchStatus.VALIDATING))


def claim_jobs(
    session: Session,
    job_ids: Sequence[uuid.UUID],
    *,
    worker: Optional[str],
    lease_s: float,
    max_attempts: Optional[int] = None,
) -> dict[uuid.UUID, Claim]:
    """Claim many jobs in one transaction, each as a lease; the batch rows are never locked.

    A job is claimable when it is ``queued``, or ``running`` under a lease that has expired (its
    holder died or lost the database). Claiming sets ``running``, increments ``attempts`` and
    ``lease_token`` (the fencing token every later write of this claim must carry), and stamps
    ``worker``, ``claimed_at`` and ``lease_expires_at = now + lease_s``. Concurrent claims of one
    job serialize on its row: exactly one of them gets it. A claimable job already started
    ``max_attempts`` times is a poison job and ends ``failed`` instead, with its batch's counters.

    Args:
        job_ids: the jobs to claim (duplicates are claimed once).
        worker: the claiming worker's name (``weir.jobs.worker``).
        lease_s: the lease's length in seconds; the holder renews it (:func:`renew_leases`).
        max_attempts: the most starts a job gets; None for no limit.

    Returns:
        One :class:`Claim` per distinct id.
    """
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    now = utcnow()
    claims: dict[uuid.UUID, Claim] = {}
    dialect = session.get_bind().dialect.name
    params = {"ids": _ids_param(ids, dialect), "now": now, "max_attempts": max_attempts}
    if max_attempts is not None:
        gave_up = session.execute(_claim_sql(dialect, "gave_up"), params).all()
        _count_transitions(session, [(_as_uuid(row[1]), JobStatus.FAILED) for row in gave_up], now)
        claims.update({_as_uuid(row[0]): Claim(ClaimStatus.GAVE_UP) for row in gave_up})
    expires = now + timedelta(seconds=lease_s)
    found = session.execute(_claim_sql(dialect, "claim", limited=max_attempts is not None),
                            dict(params, expires=expires, worker=worker)).all()
    claimed = [_claimed_job(row, dialect) for row in found]
    for job in claimed:
        claims[job.id] = Claim(ClaimStatus.CLAIMED, job, expires)
    started = sorted({job.batch_id for job in claimed})
    if started:  # only a batch's first claims find it queued; later ones match no row
        session.execute(_claim_sql(dialect, "start_batches"), {"ids": _ids_param(started, dialect), "now": now})
    rest = [job_id for job_id in ids if job_id not in claims]
    if rest:
        for row in session.execute(_claim_sql(dialect, "rest"), {"ids": _ids_param(rest, dialect)}).all():
            job_id, status, lease_expires_at = _as_uuid(row[0]), JobStatus(row[1]), row[2]
            if status.is_finished:
                claims[job_id] = Claim(ClaimStatus.FINISHED)
            else:
                if isinstance(lease_expires_at, str):  # SQLite hands text back
                    lease_expires_at = datetime.fromisoformat(lease_expires_at)
                claims[job_id] = Claim(ClaimStatus.HELD, lease_expires_at=lease_expires_at)
        for job_id in rest:
            claims.setdefault(job_id, Claim(ClaimStatus.UNKNOWN))
    return claims


_CLAIMED_COLUMNS = ("id", "batch_id", "batch_index", "custom_id", "kind", "model", "request", "status",
                    "attempts", "lease_token", "worker", "started_at", "claimed_at")


@functools.lru_cache(maxsize=None)
def _claim_sql(dialect: str, which: str, limited: bool = False) -> Any:
    """The statements of :func:`claim_jobs`, as SQL compiled once (their id sets are one array
    parameter, not an ``IN`` list re-rendered for every size)."""
    in_ids = "= ANY(:ids)" if dialect == "postgresql" else "IN (SELECT value FROM json_each(:ids))"
    claimable = (f"jobs.id {in_ids} AND (jobs.status = 'queued' OR (jobs.status = 'running' AND "
                 "(jobs.lease_expires_at IS NULL OR jobs.lease_expires_at <= :now))) "
                 "AND jobs.batch_id IN (SELECT id FROM batches WHERE status <> 'validating')")
    concat = "'gave up after ' || CAST(attempts AS TEXT) || ' attempts: each one lost its worker or ran out of time'"
    sql = {
        "gave_up": (f"UPDATE jobs SET status = 'failed', error = {concat}, finished_at = :now, "
                    f"lease_expires_at = NULL WHERE {claimable} AND jobs.attempts >= :max_attempts "
                    "RETURNING jobs.id, jobs.batch_id"),
        "claim": ("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_token = lease_token + 1, "
                  "started_at = COALESCE(started_at, :now), claimed_at = :now, lease_expires_at = :expires, "
                  f"worker = :worker WHERE {claimable}"
                  + (" AND jobs.attempts < :max_attempts" if limited else "")
                  + " RETURNING " + ", ".join(f"jobs.{c}" for c in _CLAIMED_COLUMNS)),
        "start_batches": (f"UPDATE batches SET status = 'in_progress', started_at = :now "
                          f"WHERE batches.id {in_ids} AND batches.status = 'queued'"),
        "rest": (f"SELECT jobs.id, jobs.status, jobs.lease_expires_at FROM jobs WHERE jobs.id {in_ids} "
                 "AND jobs.batch_id IN (SELECT id FROM batches WHERE status <> 'validating')"),
    }[which]
    return text(sql)


def _ids_param(ids: Sequence[uuid.UUID], dialect: str) -> Any:
    """A set of ids as :func:`_claim_sql`'s ``:ids``: a uuid array, or SQLite's JSON array of hex."""
    return list(ids) if dialect == "postgresql" else json.dumps([i.hex for i in ids])


def _claimed_job(row: Any, dialect: str) -> Job:
    """A detached ``Job`` from a claim's RETURNING row (readable after the transaction)."""
    values = dict(zip(_CLAIMED_COLUMNS, row))
    values["id"], values["batch_id"] = _as_uuid(values["id"]), _as_uuid(values["batch_id"])
    values["kind"], values["status"] = JobKind(values["kind"]), JobStatus(values["status"])
    if isinstance(values["request"], str):  # SQLite's JSON and times are text
        values["request"] = json.loads(values["request"])
    for name in ("started_at", "claimed_at"):
        if isinstance(values[name], str):
            values[name] = datetime.fromisoformat(values[name]).replace(tzinfo=timezone.utc)
    return Job(**values)


def claim_job(
    session: Session,
    job_id: uuid.UUID,
    *,
    worker: Optional[str] = None,
    max_attempts: Optional[int] = None,
    lease_s: float = 600.0,
) -> Optional[Job]:
    """:func:`claim_jobs` for one job: the job as claimed, or None when there is nothing to run
    (finished, out of attempts, held under a live lease by another claim, or unknown)."""
    claim = claim_jobs(session, [job_id], worker=worker, lease_s=lease_s, max_attempts=max_attempts)[job_id]
    return claim.job


def renew_leases(
    session: Session, leases: Sequence[tuple[uuid.UUID, int]], *, worker: Optional[str], lease_s: float
) -> set[uuid.UUID]:
    """Extend the leases a worker holds by ``lease_s`` seconds from now, in one statement.

    Args:
        leases: (job id, fencing token) of each job the worker runs.

    Returns:
        The ids whose lease was renewed. A job missing from it was cancelled, finished, or taken by
        another claim after its lease expired: its holder must stop and store nothing.
    """
    if not leases:
        return set()
    jobs = _jobs.c
    stmt = (
        update(_jobs)
        .where(
            tuple_(jobs.id, jobs.lease_token).in_(list(leases)),
            jobs.status == JobStatus.RUNNING,
            jobs.worker == worker if worker is not None else jobs.worker.is_(None),
        )
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        .returning(jobs.id)
    )
    return set(session.execute(stmt).scalars())


def release_jobs(
    session: Session,
    leases: Sequence[tuple[uuid.UUID, int]],
    *,
    republish_at: Optional[datetime] = None,
    refund_attempt: bool = False,
) -> set[uuid.UUID]:
    """Give leases back unfinished: each job still held under its token becomes ``queued`` again,
    so the message that goes back to the queue (or a retry's) can claim it at once. Its
    ``attempts`` keeps the cut-short start unless ``refund_attempt`` (the start failed through no
    fault of the job: an engine step failure). ``published_at`` becomes ``republish_at`` (default
    now), since its message is about to be queued again. ``lease_token`` is never given back.

    Returns:
        The ids released (a job finished or taken by another claim meanwhile is left alone).
    """
    if not leases:
        return set()
    jobs = _jobs.c
    stmt = (
        update(_jobs)
        .where(tuple_(jobs.id, jobs.lease_token).in_(list(leases)), jobs.status == JobStatus.RUNNING)
        .values(status=JobStatus.QUEUED, lease_expires_at=None, published_at=republish_at or utcnow(),
                attempts=jobs.attempts - 1 if refund_attempt else jobs.attempts)
        .returning(jobs.id)
    )
    return set(session.execute(stmt).scalars())


def job_status(session: Session, job_id: uuid.UUID) -> Optional[JobStatus]:
    """The job's current status (None: no such job)."""
    return session.scalar(select(Job.status).where(Job.id == job_id))




def record_result(session: Session, job: Job, result: JobResult) -> bool:
    """:func:`record_results` for one job. Returns True when the row took this result."""
    return job.id in record_results(session, [(job, result)])


def record_results(session: Session, results: Iterable[tuple[Job, JobResult]]) -> set[uuid.UUID]:
    """Store many jobs' outcomes in one statement, with their batches' counters.

    Each ``job`` is the row as claimed: its ``lease_token`` is the claim's fencing token. A job's
    row takes the outcome only while it is still ``running`` under that same token, so a write
    from a stale attempt (its lease expired and another claim took the job, or the job was
    cancelled, gave up or finished meanwhile) changes nothing: no row, no counter, no enrichment.
    A finished job is never changed again. Each real transition moves its batch's counters by one
    in this transaction, and the batch finishes (``completed``, or ``failed`` when every job
    failed) in the transaction whose transitions bring its counts to ``num_jobs``: exactly once.
    When one job appears more than once in ``results``, a success is kept over a failure, else the
    later one. Results are stored under the module's storage rules (:meth:`JobResult.storable`).

    Returns:
        The ids of the jobs whose row took the given outcome.

    Raises:
        ValueError: an outcome's status is not ``SUCCEEDED`` or ``FAILED``.
    """
    chosen: dict[uuid.UUID, tuple[Job, JobResult]] = {}
    for job, result in results:
        if result.status not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            raise ValueError(f"a worker writes succeeded or failed, not {result.status.value}")
        kept = chosen.get(job.id)
        if kept is None or not (kept[1].status == JobStatus.SUCCEEDED and result.status == JobStatus.FAILED):
            chosen[job.id] = (job, result)
    if not chosen:
        return set()
    now = utcnow()
    dialect = session.get_bind().dialect.name
    rows = []
    for job, result in sorted(chosen.values(), key=lambda item: item[0].id):
        values = asdict(result.storable())
        values["status"] = result.status.value
        rows.append(dict(values, id=uuid_literal(job.id, dialect), lease_token=job.lease_token))
    # One statement for the whole group: the rows travel as one JSON array joined to ``jobs``
    # (compiled once, whatever the group's size), and RETURNING yields a row only where the
    # guarded update applied: one per real transition.
    found = session.execute(_FINISH_SQL[dialect], {"rows": json.dumps(rows), "now": now}).all()
    written = {_as_uuid(row[0]) for row in found}
    _count_transitions(session, [(_as_uuid(row[1]), JobStatus(row[2])) for row in found], now)
    return written


_RESULT_FIELDS = (
    ("status", "text"), ("output_text", "text"), ("label", "text"), ("label_probs", "json"),
    ("finish_reason", "text"), ("completions", "json"), ("parsed", "json"), ("prompt_logprobs", "json"),
    ("num_prompt_tokens", "int"), ("num_completion_tokens", "int"),
    ("num_cached_tokens", "int"), ("error", "text"),
)
_SET_RESULT = ", ".join(f"{name} = v.{name}" for name, _ in _RESULT_FIELDS)
_FINISH_SQL = {
    "postgresql": text(
        f"UPDATE jobs SET {_SET_RESULT}, finished_at = :now, lease_expires_at = NULL "
        "FROM json_to_recordset(CAST(:rows AS json)) AS v(id uuid, lease_token int, "
        + ", ".join(f"{name} {kind}" for name, kind in _RESULT_FIELDS) + ") "
        "WHERE jobs.id = v.id AND jobs.status = 'running' AND jobs.lease_token = v.lease_token "
        "RETURNING jobs.id, jobs.batch_id, jobs.status"
    ),
    "sqlite": text(
        f"UPDATE jobs SET {_SET_RESULT}, finished_at = :now, lease_expires_at = NULL "
        "FROM (SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.lease_token') AS lease_token, "
        + ", ".join(
            f"json_extract(value, '$.{name}') AS {name}" if kind != "json"
            # json_quote: a JSON string stays JSON text (json_extract alone unquotes it)
            else f"CASE WHEN json_type(value, '$.{name}') = 'null' THEN NULL "
                 f"ELSE json_quote(json_extract(value, '$.{name}')) END AS {name}"
            for name, kind in _RESULT_FIELDS) + " FROM json_each(:rows)) AS v "
        "WHERE jobs.id = v.id AND jobs.status = 'running' AND jobs.lease_token = v.lease_token "
        "RETURNING jobs.id, jobs.batch_id, jobs.status"
    ),
}


def uuid_literal(value: uuid.UUID, dialect: str) -> str:
    """How a UUID column stores ``value`` in a statement's JSON rows: Postgres's text form, SQLite's 32 hex digits."""
    return value.hex if dialect == "sqlite" else str(value)


def _as_uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def _count_transitions(session: Session, transitions: Sequence[tuple[uuid.UUID, JobStatus]], now: datetime) -> None:
    """Move each batch's counters by its jobs' real transitions to a final status, one guarded
    ``UPDATE`` per batch (in id order, so two writers never deadlock), and finish a batch whose
    counts reach ``num_jobs``. The batch row is locked only from this statement to the commit."""
    deltas: dict[uuid.UUID, Counter] = {}
    for batch_id, status in transitions:
        deltas.setdefault(batch_id, Counter())[status] += 1
    for batch_id in sorted(deltas):
        delta = deltas[batch_id]
        succeeded, failed, cancelled = (delta[JobStatus.SUCCEEDED], delta[JobStatus.FAILED],
                                        delta[JobStatus.CANCELLED])
        batches = _batches.c
        finished = and_(
            batches.status.in_([BatchStatus.QUEUED, BatchStatus.IN_PROGRESS]),
            batches.num_succeeded + batches.num_failed + batches.num_cancelled + (succeeded + failed + cancelled)
            >= batches.num_jobs,
        )
        final = case((batches.num_failed + failed >= batches.num_jobs, BatchStatus.FAILED.value),
                     else_=BatchStatus.COMPLETED.value)
        session.execute(
            update(_batches)
            .where(batches.id == batch_id)
            .values(
                num_succeeded=batches.num_succeeded + succeeded,
                num_failed=batches.num_failed + failed,
                num_cancelled=batches.num_cancelled + cancelled,
                status=case((finished, final), else_=batches.status),
                finished_at=case((finished, now), else_=batches.finished_at),
            )
        )


def cancel_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    """Cancel every queued or running job of a batch and mark the batch ``cancelled``.

    Finished jobs keep their results. Workers skip cancelled jobs when their message arrives, and
    a worker running one aborts it in the engine within ``WEIR_CANCEL_POLL_INTERVAL_S`` (its lease
    renewal finds the job gone); its result is never stored. The cancelled jobs move the batch's
    ``num_cancelled`` in this transaction.

    Raises:
        LookupError: no batch has this id.
    """
    batch = get_batch(session, batch_id)
    if batch.status.is_finished:
        return batch
    now = utcnow()
    # rows are locked in id order, the order the workers' claims take them in
    is_open = Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING])
    open_jobs = select(Job.id).where(Job.batch_id == batch_id, is_open).order_by(Job.id).with_for_update()
    num_cancelled = session.execute(
        update(Job)
        .where(Job.id.in_(open_jobs), is_open)
        .values(status=JobStatus.CANCELLED, finished_at=now, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            num_cancelled=Batch.num_cancelled + num_cancelled,
            status=case((Batch.status.in_([BatchStatus.QUEUED, BatchStatus.IN_PROGRESS]),
                         BatchStatus.CANCELLED.value), else_=Batch.status),
            finished_at=func.coalesce(Batch.finished_at, now),
        )
        .execution_options(synchronize_session=False)
    )
    return get_batch(session, batch_id)


def cancel_job(session: Session, job_id: uuid.UUID) -> Job:
    """Cancel one queued or running job (as :func:`cancel_batch` does); a finished job is kept.

    Returns:
        The job as it now stands.

    Raises:
        LookupError: no job has this id.
    """
    now = utcnow()
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        .values(status=JobStatus.CANCELLED, finished_at=now, lease_expires_at=None)
        .returning(Job.batch_id)
        .execution_options(synchronize_session=False)
    ).scalars().all()
    _count_transitions(session, [(batch_id, JobStatus.CANCELLED) for batch_id in cancelled], now)
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise LookupError(f"no job with id {job_id}")
    return job


@dataclass(frozen=True)
class Reconciled:
    """A batch whose stored counters differed from a recount: before and after."""

    batch_id: uuid.UUID
    before: tuple[int, int, int, str]
    after: tuple[int, int, int, str]


def reconcile_batches(session: Session, batch_ids: Optional[Sequence[uuid.UUID]] = None) -> list[Reconciled]:
    """Recount batches from ``jobs`` and repair counters or status that differ (the rare check;
    the counters move transactionally, so a difference means a row was changed by hand).

    Each batch is recounted under its row lock. A batch whose counts reach ``num_jobs`` is
    finished as :func:`record_results` would have finished it.

    Args:
        batch_ids: the batches to check; None checks every batch not yet finished.

    Returns:
        The batches that were repaired.
    """
    if batch_ids is None:
        batch_ids = list(session.execute(
            select(Batch.id).where(Batch.status.in_([BatchStatus.QUEUED, BatchStatus.IN_PROGRESS]))
        ).scalars())
    repaired = []
    for batch_id in sorted(batch_ids):
        batch = session.execute(
            select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
        ).scalar_one_or_none()
        if batch is None or batch.status == BatchStatus.VALIDATING:
            continue
        counts = dict(session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
        ).all())
        before = (batch.num_succeeded, batch.num_failed, batch.num_cancelled, batch.status.value)
        batch.num_succeeded = counts.get(JobStatus.SUCCEEDED, 0)
        batch.num_failed = counts.get(JobStatus.FAILED, 0)
        batch.num_cancelled = counts.get(JobStatus.CANCELLED, 0)
        if batch.num_succeeded + batch.num_failed + batch.num_cancelled >= batch.num_jobs and not batch.status.is_finished:
            all_failed = batch.num_jobs > 0 and batch.num_failed == batch.num_jobs
            batch.status = BatchStatus.FAILED if all_failed else BatchStatus.COMPLETED
            batch.finished_at = utcnow()
        after = (batch.num_succeeded, batch.num_failed, batch.num_cancelled, batch.status.value)
        if after != before:
            repaired.append(Reconciled(batch_id, before, after))
    session.flush()
    return repaired


def take_jobs_to_publish(
    session: Session,
    *,
    model: str,
    older_than: datetime,
    limit: int = 1000,
    queued_before: Optional[datetime] = None,
    queued_before_job: Optional[tuple[uuid.UUID, int]] = None,
) -> list[uuid.UUID]:
    """Find jobs whose message is missing and stamp them published now (the sweeper's read).

    Taken, of batches no longer ``validating``:

    - ``queued`` jobs never published (``published_at`` null: a publish failed), at once;
    - ``running`` jobs whose lease expired before ``older_than`` and that were not published since
      it expired (their worker died; Redis may have lost or may still hold their message);
    - ``queued`` jobs last published before ``queued_before``: the caller passes the publish time
      of the oldest message still waiting in the queue (less a grace), before which every message
      has been taken from the queue, so such a job's message is lost; or ``older_than`` when the
      queue is empty. None takes none of these. ``queued_before_job`` (batch id, index) also
      takes the jobs of that batch published at exactly ``queued_before`` with a lower index (one
      publish sends a batch's messages in index order under one time).

    Rows are taken with ``FOR UPDATE SKIP LOCKED``, so two sweepers never take the same job.

    Returns:
        The ids, oldest publish first, now with ``published_at`` = now (not committed).
    """
    lost = [
        and_(Job.status == JobStatus.QUEUED, Job.published_at.is_(None)),
        and_(Job.status == JobStatus.RUNNING, Job.lease_expires_at < older_than,
             or_(Job.published_at.is_(None), Job.published_at < Job.lease_expires_at)),
    ]
    if queued_before is not None:
        before = Job.published_at < queued_before
        if queued_before_job is not None:
            batch_id, index = queued_before_job
            before = or_(before, and_(Job.published_at == queued_before, Job.batch_id == batch_id,
                                      Job.batch_index < index))
        lost.append(and_(Job.status == JobStatus.QUEUED, before))
    stmt = (
        select(Job.id)
        .where(Job.model == model, or_(*lost), _not_validating())
        # The order they are published in again: a batch's jobs by index (see ``queued_before_job``).
        .order_by(Job.published_at.asc().nulls_first(), Job.batch_id, Job.batch_index)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = list(session.execute(stmt).scalars())
    if ids:
        mark_published(session, ids, utcnow())
    return ids


def publish_position(session: Session, job_id: uuid.UUID) -> Optional[tuple[datetime, uuid.UUID, int]]:
    """(``published_at``, batch id, batch index) of a job (None: never published, or no such job)."""
    row = session.execute(select(Job.published_at, Job.batch_id, Job.batch_index).where(Job.id == job_id)).first()
    return None if row is None or row[0] is None else (row[0], row[1], row[2])


def mark_published(session: Session, job_ids: Sequence[uuid.UUID], when: Optional[datetime]) -> None:
    """Set ``published_at`` of the jobs to ``when`` (None: not published, sweep at once)."""
    session.execute(
        update(Job)
        .where(Job.id.in_(list(job_ids)))
        .values(published_at=when)
        .execution_options(synchronize_session=False)
    )

def record_dead_letter(
    session: Session,
    *,
    body: Any,
    reason: str,
    queue: Optional[str] = None,
    task: Optional[str] = None,
    message_id: Optional[str] = None,
) -> DeadLetter:
    """Keep a message the worker could not read (added and flushed, not committed).

    Args:
        body: the message body (bytes are decoded as UTF-8 with replacement; other values are
            stored as their ``repr``); cut to ``MAX_DEAD_LETTER_BODY_CHARS`` characters.
        reason: why it was refused, e.g. ``"args must be [job_id], got [42, 'x']"``.
    """
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    elif not isinstance(body, str):
        body = repr(body)
    letter = DeadLetter(
        queue=queue, task=task, message_id=message_id,
        body=_text(body[:MAX_DEAD_LETTER_BODY_CHARS]), reason=_text(reason),
    )
    session.add(letter)
    session.flush()
    return letter


def get_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    """Load a batch (no lock).

    Raises:
        LookupError: no batch has this id.
    """
    batch = session.get(Batch, batch_id, populate_existing=True)
    if batch is None:
        raise LookupError(f"no batch with id {batch_id}")
    return batch


def recent_batches(session: Session, limit: int) -> list[Batch]:
    """The ``limit`` most recently created batches, newest first (``ix_batches_created_at``)."""
    stmt = select(Batch).order_by(Batch.created_at.desc(), Batch.id).limit(limit)
    return list(session.execute(stmt).scalars())


def list_jobs(session: Session, batch_id: uuid.UUID) -> list[Job]:
    """A batch's jobs in submission order."""
    stmt = select(Job).where(Job.batch_id == batch_id).order_by(Job.batch_index)
    return list(session.execute(stmt).scalars())


def jobs_page(session: Session, batch_id: uuid.UUID, *, first_index: int, limit: int) -> list[Job]:
    """Up to ``limit`` of a batch's jobs from batch index ``first_index`` on, in submission order
    (one range scan of the ``(batch_id, batch_index)`` index: a keyset page)."""
    stmt = (
        select(Job)
        .where(Job.batch_id == batch_id, Job.batch_index >= first_index)
        .order_by(Job.batch_index)
        .limit(limit)
    )
    return list(session.execute(stmt).scalars())
