"""One delivery of a ``run_job`` message: claim the job's lease, run the engine, store the outcome.

Every database write goes through the process's :class:`weir.worker.group_commit.GroupCommitter`, so
it shares a transaction with other jobs' writes, and returns only once committed. What the task
does with each :class:`Outcome` (see README "Guarantees"):

- ``DONE``: the result, the final failure, or nothing-to-do is committed; the message is acked.
- ``REQUEUE``: the engine is shutting down, an engine step failed with the job in flight, or the
  database stayed unreachable for ``WEIR_DB_RETRY_TIMEOUT_S``; the job's lease was given back
  (when the database allowed) and the message goes back to the queue (``Reject(requeue=True)``).
- ``RETRY``: the attempt timed out and the job has attempts left, or another claim's lease on
  the job is live (a duplicate delivery: it runs elsewhere, and this message comes back once the
  lease would have expired, finding the job finished, or claimable if its holder died); Celery
  publishes it again after ``countdown_s``.

Transient database errors are retried by the committer while the message stays unacked; the
engine's result is kept in memory meanwhile, so a database outage never costs a second engine run.
"""

from __future__ import annotations

import enum
import logging
import uuid
from dataclasses import dataclass
import time
from typing import Any, Callable, Optional, TypeVar

from celery.utils.time import get_exponential_backoff_interval

from weir.jobs import results
from weir.jobs.claims import ClaimStatus
from weir.jobs.db import Job, utcnow
from weir.jobs.results import JobResult
from weir.jobs.retry import first_line, is_transient, retry
from weir.worker.group_commit import DatabaseUnavailable
from weir.worker.runtime import EngineFailed, EngineStopping, JobCancelled, JobTimedOut, WorkerRuntime

logger = logging.getLogger(__name__)

__all__ = ["Attempt", "Outcome", "MalformedMessage", "DatabaseUnavailable",
           "parse_job_id", "run_attempt", "dead_letter"]


class Outcome(enum.Enum):
    DONE = "done"
    REQUEUE = "requeue"
    RETRY = "retry"


@dataclass(frozen=True)
class Attempt:
    """What became of one delivery: the outcome, why, and (``RETRY``) the delay in seconds."""

    outcome: Outcome
    reason: str = ""
    countdown_s: float = 0.0


class MalformedMessage(ValueError):
    """A ``run_job`` message whose arguments are not ``[job_id]``."""


T = TypeVar("T")


def with_db_retry(runtime: WorkerRuntime, what: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` (one database transaction outside the group committer, e.g. a dead letter)
    until it does not fail transiently.

    Backoff: 1, 2, 4, 8, then 10 s between tries (Celery's exponential backoff), for at most
    ``WEIR_DB_RETRY_TIMEOUT_S`` seconds in all.

    Raises:
        DatabaseUnavailable: still failing after the timeout.
        EngineStopping: the worker is shutting down and its grace period is over.
        Exception: any error of ``fn`` that is not transient, unchanged.
    """
    timeout_s = runtime.settings.worker.db_retry_timeout_s
    deadline = time.monotonic() + timeout_s

    def give_up(exc: BaseException, num_tries: int, wait_s: float) -> BaseException | None:
        if time.monotonic() + wait_s > deadline:
            return DatabaseUnavailable(f"{what}: database unreachable for {timeout_s:g}s: {first_line(exc)}")
        if runtime.is_stopping:  # the shutdown grace period is over
            return EngineStopping("the worker is shutting down")
        logger.warning("%s: transient database error, try %d in %ds: %s", what, num_tries + 1, wait_s,
                       first_line(exc))
        return None

    return retry(fn, retryable=is_transient, give_up=give_up, sleep=time.sleep)


def parse_job_id(args: tuple, kwargs: dict) -> uuid.UUID:
    """The job id of a ``run_job`` message, whose arguments must be exactly ``[job_id]``.

    Raises:
        MalformedMessage: other arguments, or an id that is not a UUID string.
    """
    if kwargs or len(args) != 1:
        raise MalformedMessage(f"run_job takes args [job_id], got args {list(args)!r} kwargs {kwargs!r}")
    (job_id,) = args
    if not isinstance(job_id, str):
        raise MalformedMessage(f"job id must be a UUID string, got {type(job_id).__name__} {job_id!r}")
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise MalformedMessage(f"job id {job_id!r} is not a UUID") from None


def run_attempt(runtime: WorkerRuntime, job_id: uuid.UUID, *, worker: str) -> Attempt:
    """Claim job ``job_id``, run it, store its outcome; see the module docstring for the outcomes.

    Args:
        runtime: this process's engine and database.
        job_id: the job row to run.
        worker: this worker's name, stored on the claim.

    Raises:
        Exception: a non-transient database error while claiming (the task puts the message back
            on the queue after a backoff; see ``weir.worker.tasks.run_job``).
    """
    settings = runtime.settings.worker
    writer = runtime.writer(worker)
    try:
        claim = writer.claim(job_id)
    except DatabaseUnavailable as exc:
        return Attempt(Outcome.REQUEUE, str(exc))
    if claim.status == ClaimStatus.HELD:
        return Attempt(Outcome.RETRY, "held under another claim's live lease (a duplicate delivery)",
                       held_wait_s(claim, settings.lease_s))
    if claim.status != ClaimStatus.CLAIMED:
        return Attempt(Outcome.DONE, f"nothing to run ({claim.status.value})")
    job = claim.job
    claimed_at = time.monotonic()
    kind = job.kind.value
    runtime.hold(job)
    try:
        try:
            runtime.begin_run(job)
            result = runtime.run(job)
        except JobCancelled:
            return Attempt(Outcome.DONE, "cancelled or lease lost while running")
        except (EngineStopping, EngineFailed) as exc:
            # An engine failure is not the job's, and a job that never reached the engine did not
            # start: either start is given back, not counted.
            refund = isinstance(exc, EngineFailed) or not exc.started
            release_lease(writer, job, refund_attempt=refund)
            what = "engine step failed" if isinstance(exc, EngineFailed) else "engine stopping"
            return Attempt(Outcome.REQUEUE, f"{what}: {exc}")
        except JobTimedOut as exc:
            if job.attempts < settings.max_attempts:
                release_lease(writer, job)
                return Attempt(Outcome.RETRY, str(exc), get_exponential_backoff_interval(1, job.attempts, 60))
            result = JobResult.failure(f"JobTimedOut: {exc} on each of {job.attempts} attempts")
        try:
            stored = _store(writer, job, result)
        except DatabaseUnavailable as exc:
            return Attempt(Outcome.REQUEUE, str(exc))
        if stored is None:
            return Attempt(Outcome.DONE, "result dropped: the job was cancelled, finished or taken by another claim")
        runtime.metrics.job_finished(kind, stored.status.value, time.monotonic() - claimed_at)
        return Attempt(Outcome.DONE, stored.status.value)
    finally:
        runtime.drop(job)


def held_wait_s(claim: Any, lease_s: float) -> float:
    """Seconds until a HELD claim's lease would have expired, plus one (1 to ``lease_s + 1``):
    when a duplicate delivery should look again."""
    wait_s = 1.0
    if claim.lease_expires_at is not None:
        expires = claim.lease_expires_at
        if expires.tzinfo is None:  # SQLite keeps no zone; every stored time is UTC
            expires = expires.replace(tzinfo=utcnow().tzinfo)
        wait_s = (expires - utcnow()).total_seconds() + 1.0
    return min(max(1.0, wait_s), lease_s + 1.0)


def release_lease(writer: Any, job: Job, *, refund_attempt: bool = False) -> None:
    """Give the lease back so the requeued message can claim the job at once; should the
    database not answer, the lease expires by itself after ``WEIR_LEASE_S``."""
    try:
        writer.release(job, refund_attempt=refund_attempt)
    except Exception as exc:
        logger.warning("job %s: lease not given back (%s); it expires by itself", job.id, exc)


def _store(writer: Any, job: Job, result: JobResult) -> Optional[JobResult]:
    """Store the result (and enrichment) through the committer; a result the database refuses
    for good (not transiently) is replaced by a failure naming why, so the job never stays
    ``running``. Returns the result stored, or None when the claim was stale (nothing stored)."""
    try:
        return result if writer.finish(job, result) else None
    except DatabaseUnavailable:
        raise
    except Exception as exc:
        logger.exception("job %s: the database refused its result", job.id)
        failure = JobResult.failure(f"result not stored: {type(exc).__name__}: {first_line(exc)}")
        return failure if writer.finish(job, failure) else None


def dead_letter(runtime: Any, *, body: Any, reason: str, queue: Optional[str], task: Optional[str],
                message_id: Optional[str]) -> None:
    """Keep an unreadable message in ``dead_letters`` (retrying transient database errors)."""

    def transaction() -> None:
        with runtime.session_factory.begin() as session:
            results.record_dead_letter(session, body=body, reason=reason, queue=queue, task=task,
                                       message_id=message_id)

    logger.error("dead letter (task %s, id %s): %s", task, message_id, reason)
    with_db_retry(runtime, "dead letter", transaction)
