"""One delivery of a ``run_job`` message: claim the row, run the engine, store the outcome.

What the task does with each :class:`Outcome` (see README "Guarantees"):

- ``DONE``: the result, the final failure, or nothing-to-do is committed; the message is acked.
- ``REQUEUE``: the engine is shutting down, or the database stayed unreachable for
  ``WEIR_DB_RETRY_TIMEOUT_S``; nothing was stored and the message goes back to the queue
  (``Reject(requeue=True)``).
- ``RETRY``: the attempt timed out and the job has attempts left; Celery publishes it again
  after a backoff.

Transient database errors (lost connection, refused connection, serialization failure, failover)
are retried here with exponential backoff while the message stays unacked; the engine's result is
kept in memory meanwhile, so a database outage never costs a second engine run.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from celery.utils.time import get_exponential_backoff_interval
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from jobs import store
from jobs.db import Job, JobStatus
from jobs.store import JobResult
from worker.runtime import EngineStopping, JobCancelled, JobTimedOut, WorkerRuntime

logger = logging.getLogger(__name__)

MAX_DB_BACKOFF_S = 10
T = TypeVar("T")


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


class DatabaseUnavailable(RuntimeError):
    """Transient database errors went on for longer than ``WEIR_DB_RETRY_TIMEOUT_S``."""


class MalformedMessage(ValueError):
    """A ``run_job`` message whose arguments are not ``[job_id]``."""


def is_transient(exc: BaseException) -> bool:
    """Database errors worth retrying: lost or refused connections, serialization failures and
    deadlocks, lock timeouts, failover (all ``OperationalError``/``InterfaceError`` under psycopg),
    busy SQLite."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def with_db_retry(runtime: WorkerRuntime, what: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` (one database transaction) until it does not fail transiently.

    Backoff: 1, 2, 4, 8, then 10 s between tries (Celery's exponential backoff), for at most
    ``WEIR_DB_RETRY_TIMEOUT_S`` seconds in all.

    Raises:
        DatabaseUnavailable: still failing after the timeout.
        EngineStopping: the worker is shutting down and its grace period is over.
        Exception: any error of ``fn`` that is not transient, unchanged.
    """
    timeout_s = runtime.settings.worker.db_retry_timeout_s
    deadline = time.monotonic() + timeout_s
    num_tries = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay_s = get_exponential_backoff_interval(1, num_tries, MAX_DB_BACKOFF_S)
            num_tries += 1
            if time.monotonic() + delay_s > deadline:
                raise DatabaseUnavailable(f"{what}: database unreachable for {timeout_s:g}s: {exc}") from exc
            logger.warning("%s: transient database error, try %d in %ds: %s", what, num_tries + 1, delay_s,
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            time.sleep(delay_s)
            if runtime.is_stopping:  # the shutdown grace period is over
                raise EngineStopping("the worker is shutting down") from exc


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
        Exception: a non-transient database error while claiming (the message is then acked
            by Celery as a failed task; the sweeper finds the job again if it stays queued).
    """
    settings = runtime.settings.worker
    try:
        job = with_db_retry(runtime, f"job {job_id}: claim", lambda: _claim(runtime, job_id, worker))
        if job is None:
            return Attempt(Outcome.DONE, "nothing to run (finished, cancelled, out of attempts or unknown)")
        try:
            result = runtime.run(job, is_cancelled=lambda: _is_cancelled(runtime, job_id))
        except JobCancelled:
            return Attempt(Outcome.DONE, "cancelled while running")
        except JobTimedOut as exc:
            if job.attempts < settings.max_attempts:
                return Attempt(Outcome.RETRY, str(exc), get_exponential_backoff_interval(1, job.attempts, 60))
            result = JobResult.failure(f"JobTimedOut: {exc} on each of {job.attempts} attempts")
        _store(runtime, job, result)
        return Attempt(Outcome.DONE, result.status.value)
    except EngineStopping as exc:
        return Attempt(Outcome.REQUEUE, f"engine stopping: {exc}")
    except DatabaseUnavailable as exc:
        return Attempt(Outcome.REQUEUE, str(exc))


def _claim(runtime: WorkerRuntime, job_id: uuid.UUID, worker: str) -> Optional[Job]:
    with runtime.session_factory.begin() as session:
        return store.claim_job(session, job_id, worker=worker, max_attempts=runtime.settings.worker.max_attempts)


def _is_cancelled(runtime: WorkerRuntime, job_id: uuid.UUID) -> bool:
    try:
        with runtime.session_factory() as session:
            return store.job_status(session, job_id) == JobStatus.CANCELLED
    except Exception as exc:  # a database hiccup must not abort a healthy job
        if not is_transient(exc):
            raise
        return False


def _store(runtime: WorkerRuntime, job: Job, result: JobResult) -> None:
    """Store the result and the enrichment in one transaction; a result the database refuses
    for good (not transiently) is replaced by a failure naming why, so the job never stays
    ``running``."""

    def write(outcome: JobResult) -> Callable[[], None]:
        def transaction() -> None:
            with runtime.session_factory.begin() as session:
                if store.record_result(session, job, outcome):
                    store.record_enrichment(session, job, outcome, model=runtime.model_name)

        return transaction

    try:
        with_db_retry(runtime, f"job {job.id}: store result", write(result))
    except (DatabaseUnavailable, EngineStopping):
        raise
    except Exception as exc:
        logger.exception("job %s: the database refused its result", job.id)
        failure = JobResult.failure(f"result not stored: {type(exc).__name__}: {_first_line(exc)}")
        with_db_retry(runtime, f"job {job.id}: store failure", write(failure))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def dead_letter(runtime: Any, *, body: Any, reason: str, queue: Optional[str], task: Optional[str],
                message_id: Optional[str]) -> None:
    """Keep an unreadable message in ``dead_letters`` (retrying transient database errors)."""

    def transaction() -> None:
        with runtime.session_factory.begin() as session:
            store.record_dead_letter(session, body=body, reason=reason, queue=queue, task=task,
                                     message_id=message_id)

    logger.error("dead letter (task %s, id %s): %s", task, message_id, reason)
    with_db_retry(runtime, "dead letter", transaction)
