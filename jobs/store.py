"""Reads and writes of batches, jobs and enrichment rows. Callers own the session and transaction.

Concurrency rule: every function that changes a job first locks the job's batch row
(``SELECT ... FOR UPDATE`` on Postgres; SQLite's ``BEGIN IMMEDIATE`` already serializes writers),
then writes the job, then recounts the batch from ``jobs``. Writes to one batch are therefore
serialized, and in READ COMMITTED each recount sees every job committed before it, so the counts
never drift however many task threads or workers finish jobs at once.

Result writes are upserts keyed by job id (``INSERT .. ON CONFLICT (id) DO UPDATE .. WHERE``):
a redelivered job never makes a second row, and a guard keeps a late failure from overwriting a
success.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from jobs.db import Batch, BatchStatus, Job, JobKind, JobStatus, ProductEnrichment, utcnow
from jobs.schemas import JobRequest


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
        ValueError: two requests share a ``custom_id``.
    """
    custom_ids = [r.custom_id if r.custom_id is not None else str(i) for i, r in enumerate(requests)]
    seen: set[str] = set()
    for custom_id in custom_ids:
        if custom_id in seen:
            raise ValueError(f"custom_id {custom_id!r} appears more than once in the batch")
        seen.add(custom_id)
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
        )
        for i, (request, custom_id) in enumerate(zip(requests, custom_ids))
    ]
    session.add_all(jobs)
    session.flush()
    return batch, jobs


def claim_job(session: Session, job_id: uuid.UUID) -> Optional[Job]:
    """Mark a job running and count the attempt, unless it is already finished.

    A ``running`` job is claimed again: that is a redelivery after a worker died or a retry.

    Returns:
        The job, now ``running`` with ``attempts`` incremented; None when no such job exists or
        it is finished (succeeded, failed or cancelled), i.e. there is nothing to run.
    """
    job = session.get(Job, job_id)
    if job is None:
        return None
    batch = lock_batch(session, job.batch_id)
    now = utcnow()
    claimed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        .values(
            status=JobStatus.RUNNING,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, now),
        )
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).first()
    if claimed is None:
        return None
    if batch.status == BatchStatus.QUEUED:
        batch.status = BatchStatus.IN_PROGRESS
        batch.started_at = now
    session.flush()
    session.refresh(job)
    return job


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
    """Upsert a job's result keyed by its id, then recount its batch.

    A stored ``succeeded`` or ``cancelled`` result is never overwritten: a redelivered or late
    write is dropped. Writing the same result twice leaves one row with that result.

    Args:
        job: the job as claimed (its identity columns are re-sent for the insert branch).
        result: the outcome; ``status`` must be ``SUCCEEDED`` or ``FAILED``.

    Returns:
        True when the row took this result, False when the guard dropped it.

    Raises:
        ValueError: ``result.status`` is not a final status a worker may write.
    """
    if result.status not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        raise ValueError(f"a worker writes succeeded or failed, not {result.status.value}")
    lock_batch(session, job.batch_id)
    values = asdict(result)
    values["finished_at"] = utcnow()
    stmt = _insert(session, Job).values(
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
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[Job.id],
        set_={name: stmt.excluded[name] for name in _RESULT_COLUMNS},
        where=Job.status.not_in([JobStatus.SUCCEEDED, JobStatus.CANCELLED]),
    )
    # RETURNING yields the row only when it was inserted or the guarded update applied.
    written = session.execute(stmt.returning(Job.id)).first() is not None
    refresh_batch(session, job.batch_id)
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
    """Cancel every queued job of a batch and mark the batch ``cancelled``.

    Running jobs finish and keep their results. Workers skip cancelled jobs when they arrive.

    Raises:
        LookupError: no batch has this id.
    """
    batch = lock_batch(session, batch_id)
    if batch.status.is_finished:
        return batch
    now = utcnow()
    session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, finished_at=now)
        .execution_options(synchronize_session=False)
    )
    batch.status = BatchStatus.CANCELLED
    batch.finished_at = now
    return refresh_batch(session, batch_id)


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
