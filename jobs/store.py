"""Reads and writes of batches, jobs and enrichment rows. Callers own the session and transaction.

Concurrency rule: every function that changes a job first locks the job's batch row
(``SELECT ... FOR UPDATE`` on Postgres; SQLite's ``BEGIN IMMEDIATE`` already serializes writers),
then writes the job, then recounts the batch from ``jobs``. Writes to one batch are therefore
serialized, and in READ COMMITTED each recount sees every job committed before it, so the counts
never drift however many task threads or workers finish jobs at once.

Result writes are upserts keyed by job id (``INSERT .. ON CONFLICT (id) DO UPDATE .. WHERE``):
a redelivered job never makes a second row, and a guard keeps a late failure from overwriting a
success.

Storage rules for results (the same on Postgres and SQLite): a NUL character (U+0000) in any text
result (generated text, label, error) is stored as U+FFFD, since Postgres text cannot hold NUL;
nothing else changes and nothing is cut. NaN and Infinity in ``label_probs`` (and a non-finite
``category_confidence``) are stored as null.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any, Iterable, Optional, Sequence

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from jobs.db import (
    MAX_DEAD_LETTER_BODY_CHARS,
    Batch,
    BatchStatus,
    DeadLetter,
    Job,
    JobKind,
    JobStatus,
    ProductEnrichment,
    utcnow,
)
from jobs.schemas import JobRequest, check_json

NUL_REPLACEMENT = "\ufffd"
"""What a NUL character in a text result is stored as (Postgres text cannot hold U+0000)."""


@dataclass
class JobResult:
    """The outcome of running one job, as the worker hands it to :func:`record_result`.

    ``status`` is ``SUCCEEDED`` or ``FAILED``; a failure carries ``error`` and no output.
    ``label_probs`` maps each label to its probability (summing to 1).
    """

    status: JobStatus
    output_text: Optional[str] = None
    label: Optional[str] = None
    label_probs: Optional[dict[str, float]] = None
    finish_reason: Optional[str] = None
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
            error=_text(self.error),
        )


def _text(value: Optional[str]) -> Optional[str]:
    return None if value is None else value.replace("\x00", NUL_REPLACEMENT)


def _insert(session: Session, model: type) -> Any:
    """The dialect's ``insert`` construct (it alone has ``on_conflict_do_update``)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"upserts are written for postgresql and sqlite, not {dialect}")
    return insert(model)


def lock_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    """Load a batch row locked for update (a no-op lock on SQLite).

    Raises:
        LookupError: no batch has this id.
    """
    stmt = (
        select(Batch)
        .where(Batch.id == batch_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    batch = session.execute(stmt).scalar_one_or_none()
    if batch is None:
        raise LookupError(f"no batch with id {batch_id}")
    return batch


def create_batch(
    session: Session,
    requests: Sequence[JobRequest],
    *,
    model: str,
    metadata: Optional[dict[str, Any]] = None,
) -> tuple[Batch, list[Job]]:
    """Add a queued batch and one queued job per request (flushed, not committed).

    Args:
        requests: validated requests; a request without ``custom_id`` gets its position as one.
        model: the model name the jobs are for (also the queue they go to).
        metadata: free JSON kept on the batch.

    Returns:
        The batch and its jobs in request order.

    Raises:
        ValueError: two requests share a ``custom_id``, or ``metadata`` is not plain JSON (the
            message names the field, see :func:`jobs.schemas.check_json`).
    """
    check_json(dict(metadata or {}), "batch metadata")
    custom_ids = [r.custom_id if r.custom_id is not None else str(i) for i, r in enumerate(requests)]
    seen: set[str] = set()
    for custom_id in custom_ids:
        if custom_id in seen:
            raise ValueError(f"custom_id {custom_id!r} appears more than once in the batch")
        seen.add(custom_id)
    now = utcnow()
    batch = Batch(model=model, num_jobs=len(requests), meta=dict(metadata or {}))
    session.add(batch)
    session.flush()
    jobs = [
        Job(
            batch_id=batch.id,
            batch_index=i,
            custom_id=custom_id,
            kind=JobKind(request.kind),
            model=model,
            request=request.model_dump(mode="json", exclude_none=True),
            published_at=now,  # about to be; the client resets it when publishing fails
        )
        for i, (request, custom_id) in enumerate(zip(requests, custom_ids))
    ]
    session.add_all(jobs)
    session.flush()
    return batch, jobs


def claim_job(
    session: Session,
    job_id: uuid.UUID,
    *,
    worker: Optional[str] = None,
    max_attempts: Optional[int] = None,
) -> Optional[Job]:
    """Mark a job running and count the attempt, unless it is finished or out of attempts.

    A ``running`` job is claimed again: that is a redelivery after a worker died, a timeout or a
    retry. A job already started ``max_attempts`` times without finishing is a poison job: it is
    marked ``failed`` with the reason instead (each of its attempts crashed or lost its worker).

    Args:
        worker: name of the claiming worker, stored in ``jobs.worker``.
        max_attempts: the most starts a job gets; None for no limit.

    Returns:
        The job, now ``running`` with ``attempts`` incremented; None when there is nothing to run:
        no such job, it is finished (succeeded, failed or cancelled), or it just failed for
        running out of attempts.
    """
    job = session.get(Job, job_id)
    if job is None:
        return None
    batch = lock_batch(session, job.batch_id)
    session.refresh(job)
    if job.status.is_finished:
        return None
    if max_attempts is not None and job.attempts >= max_attempts:
        _write_results(
            session,
            [(job, JobResult.failure(
                f"gave up after {job.attempts} attempts: each one lost its worker or ran out of time"
            ))],
        )
        return None
    now = utcnow()
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            status=JobStatus.RUNNING,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, now),
            claimed_at=now,
            worker=worker,
        )
        .execution_options(synchronize_session=False)
    )
    if batch.status == BatchStatus.QUEUED:
        batch.status = BatchStatus.IN_PROGRESS
        batch.started_at = now
    session.flush()
    session.refresh(job)
    return job


def job_status(session: Session, job_id: uuid.UUID) -> Optional[JobStatus]:
    """The job's current status (None: no such job); a running job polls it to learn of a cancel."""
    return session.scalar(select(Job.status).where(Job.id == job_id))


_RESULT_COLUMNS = (
    "status",
    "output_text",
    "label",
    "label_probs",
    "finish_reason",
    "num_prompt_tokens",
    "num_completion_tokens",
    "num_cached_tokens",
    "error",
    "finished_at",
)


def record_result(session: Session, job: Job, result: JobResult) -> bool:
    """Upsert one job's result keyed by its id, then recount its batch (see :func:`record_results`).

    Returns:
        True when the row took this result, False when the guard dropped it.

    Raises:
        ValueError: ``result.status`` is not a final status a worker may write.
    """
    return job.id in record_results(session, [(job, result)])


def record_results(session: Session, results: Iterable[tuple[Job, JobResult]]) -> set[uuid.UUID]:
    """Upsert many jobs' results in one statement keyed by job id, then recount their batches.

    A stored ``succeeded`` or ``cancelled`` result is never overwritten: a redelivered or late
    write is dropped. Writing the same result twice leaves one row with that result. When one job
    appears more than once in ``results``, one value is kept: a success over a failure, else the
    later one (one ``INSERT .. ON CONFLICT`` may not touch a row twice). Results are stored under
    the module's storage rules (:meth:`JobResult.storable`).

    Args:
        results: (job as claimed, outcome) pairs; each outcome is ``SUCCEEDED`` or ``FAILED``.

    Returns:
        The ids of the jobs whose row took the given result.

    Raises:
        ValueError: an outcome's status is not a final status a worker may write.
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
    for batch_id in sorted({job.batch_id for job, _ in chosen.values()}):  # one lock order: no deadlocks
        lock_batch(session, batch_id)
    return _write_results(session, list(chosen.values()))


def _write_results(session: Session, results: list[tuple[Job, JobResult]]) -> set[uuid.UUID]:
    """The upsert itself; the caller holds the batch locks and has removed repeated job ids."""
    now = utcnow()
    rows = []
    for job, result in results:
        values = asdict(result.storable())
        values["finished_at"] = now
        rows.append(dict(
            id=job.id,
            batch_id=job.batch_id,
            batch_index=job.batch_index,
            custom_id=job.custom_id,
            kind=job.kind,
            model=job.model,
            request=job.request,
            attempts=job.attempts,
            queued_at=job.queued_at,
            started_at=job.started_at,
            **values,
        ))
    stmt = _insert(session, Job).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=[Job.id],
        set_={name: stmt.excluded[name] for name in _RESULT_COLUMNS},
        where=Job.status.not_in([JobStatus.SUCCEEDED, JobStatus.CANCELLED]),
    )
    # RETURNING yields a row only when it was inserted or the guarded update applied.
    written = set(session.execute(stmt.returning(Job.id)).scalars())
    for batch_id in sorted({job.batch_id for job, _ in results}):
        refresh_batch(session, batch_id)
    return written


def record_enrichment(session: Session, job: Job, result: JobResult, *, model: str) -> bool:
    """Upsert the ``product_enrichment`` row of a succeeded job that names a product.

    A classification job sets ``category`` and ``category_confidence`` (the label's probability);
    a generation job sets ``description``. Fields the job does not produce are left as they are.

    Args:
        job: a job whose request metadata may hold ``product_id``.
        result: its result; nothing is written unless it succeeded.
        model: name of the model that produced it.

    Returns:
        True when a row was written.
    """
    product_id = job.request.get("metadata", {}).get("product_id")
    if product_id is None or result.status != JobStatus.SUCCEEDED:
        return False
    result = result.storable()
    if job.kind == JobKind.CLASSIFY:
        fields = {
            "category": result.label,
            "category_confidence": (result.label_probs or {}).get(result.label),
        }
    else:
        fields = {"description": result.output_text}
    fields.update(model=model, source_batch_id=job.batch_id, updated_at=utcnow())
    stmt = _insert(session, ProductEnrichment).values(product_id=str(product_id), **fields)
    stmt = stmt.on_conflict_do_update(
        index_elements=[ProductEnrichment.product_id],
        set_={name: stmt.excluded[name] for name in fields},
    )
    session.execute(stmt)
    return True


def refresh_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    """Recount a batch's jobs by status and finish the batch once every job has finished.

    Takes the batch lock first (a no-op when the transaction already holds it, as every writer
    here does before touching a job). A batch whose every job failed
    becomes ``failed``; otherwise ``completed``. A cancelled batch keeps its status.
    """
    batch = lock_batch(session, batch_id)
    counts = dict(
        session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
        ).all()
    )
    batch.num_succeeded = counts.get(JobStatus.SUCCEEDED, 0)
    batch.num_failed = counts.get(JobStatus.FAILED, 0)
    batch.num_cancelled = counts.get(JobStatus.CANCELLED, 0)
    num_finished = batch.num_succeeded + batch.num_failed + batch.num_cancelled
    if num_finished == batch.num_jobs and not batch.status.is_finished:
        all_failed = batch.num_jobs > 0 and batch.num_failed == batch.num_jobs
        batch.status = BatchStatus.FAILED if all_failed else BatchStatus.COMPLETED
        batch.finished_at = utcnow()
    session.flush()
    return batch


def cancel_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    """Cancel every queued or running job of a batch and mark the batch ``cancelled``.

    Finished jobs keep their results. Workers skip cancelled jobs when their message arrives, and
    a worker running one aborts it in the engine within ``WEIR_CANCEL_POLL_INTERVAL_S``; its
    result is then never stored.

    Raises:
        LookupError: no batch has this id.
    """
    batch = lock_batch(session, batch_id)
    if batch.status.is_finished:
        return batch
    now = utcnow()
    session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        .values(status=JobStatus.CANCELLED, finished_at=now)
        .execution_options(synchronize_session=False)
    )
    batch.status = BatchStatus.CANCELLED
    batch.finished_at = now
    return refresh_batch(session, batch_id)


def cancel_job(session: Session, job_id: uuid.UUID) -> Job:
    """Cancel one queued or running job (as :func:`cancel_batch` does); a finished job is kept.

    Returns:
        The job as it now stands.

    Raises:
        LookupError: no job has this id.
    """
    job = session.get(Job, job_id)
    if job is None:
        raise LookupError(f"no job with id {job_id}")
    lock_batch(session, job.batch_id)
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        .values(status=JobStatus.CANCELLED, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    refresh_batch(session, job.batch_id)
    session.refresh(job)
    return job


def take_jobs_to_publish(
    session: Session, *, model: str, older_than: datetime, limit: int = 1000, include_queued: bool = True
) -> list[uuid.UUID]:
    """Find jobs whose message may be lost, and stamp them published now (the sweeper's read).

    A job qualifies when it is ``queued`` and was never published or last published before
    ``older_than``, or ``running`` with both its latest claim and its latest publish before
    ``older_than`` (its worker died and no message of it was seen since). Rows are taken with
    ``FOR UPDATE SKIP LOCKED``, so two sweepers never take the same job; a second sweep right
    after the first finds nothing.

    Args:
        model: only jobs for this model (the caller publishes to that model's queue).
        older_than: the deadline, a timezone-aware UTC time.
        limit: the most ids returned.
        include_queued: False takes only the ``running`` ones (while the queue still holds
            messages, a ``queued`` job's message is most likely among them).

    Returns:
        The ids, oldest publish first, now with ``published_at`` = now (not committed).
    """
    not_since = or_(Job.published_at.is_(None), Job.published_at < older_than)
    lost = [and_(Job.status == JobStatus.RUNNING, Job.claimed_at < older_than, not_since)]
    if include_queued:
        lost.append(and_(Job.status == JobStatus.QUEUED, not_since))
    stmt = (
        select(Job.id)
        .where(Job.model == model, or_(*lost))
        .order_by(Job.published_at.asc().nulls_first())
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = list(session.execute(stmt).scalars())
    if ids:
        mark_published(session, ids, utcnow())
    return ids


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


def list_jobs(session: Session, batch_id: uuid.UUID) -> list[Job]:
    """A batch's jobs in submission order."""
    stmt = select(Job).where(Job.batch_id == batch_id).order_by(Job.batch_index)
    return list(session.execute(stmt).scalars())
