"""Celery tasks: thin adapters between a queue message, the engine and the results database.

``run_job`` hands one delivery to :func:`weir.worker.attempt.run_attempt` (claim, run, store) and maps
its outcome onto Celery: return (ack), ``Reject(requeue=True)`` (back to the queue) or
``retry`` (published again after a backoff). Logic lives in ``weir.worker.attempt``,
``weir.jobs.claims`` and ``weir.jobs.results`` (database) and ``weir.worker.runtime`` (engine). The
applications' own tasks (the catalog's nightly run) are in their packages
(:data:`weir.jobs.applications.TASKS`).
"""

from __future__ import annotations

import logging

from celery.exceptions import Reject
from celery.utils.time import get_exponential_backoff_interval

from weir.config import get_settings
from weir.jobs import names
from weir.worker.app import app, model_queue
from weir.worker.attempt import MalformedMessage, Outcome, dead_letter, parse_job_id, run_attempt
from weir.worker.runtime import get_runtime

logger = logging.getLogger(__name__)

MAX_ERROR_BACKOFF_S = 300
CHUNK_WAIT_S = 1
"""A chunk that finds every chunk place of its worker taken comes back after this long (s)."""


@app.task(name=names.RUN_JOB, bind=True, max_retries=None, typing=False)
def run_job(self, *args, **kwargs) -> None:
    """Run the job row named by the message's one argument (a job id) and store its result.

    A message with other arguments is kept in ``dead_letters`` and acked; a finished, cancelled
    or unknown job is skipped.

    Raises:
        celery.exceptions.Reject: the engine is shutting down or the database stayed unreachable;
            the message goes back to the queue.
        celery.exceptions.Retry: the attempt timed out and the job has attempts left, the job
            runs elsewhere under a live lease, or an unexpected error (then after a backoff of
            1, 2, 4 ... up to ``MAX_ERROR_BACKOFF_S`` seconds).
    """
    runtime = get_runtime()
    try:
        job_id = parse_job_id(args, kwargs)
    except MalformedMessage as exc:
        dead_letter(runtime, body={"args": list(args), "kwargs": kwargs}, reason=str(exc),
                    queue=(self.request.delivery_info or {}).get("routing_key"), task=self.name,
                    message_id=self.request.id)
        return
    try:
        attempt = run_attempt(runtime, job_id, worker=self.request.hostname or "")
    except Exception as exc:  # never ack without a stored outcome: back to the queue, later
        countdown_s = get_exponential_backoff_interval(1, self.request.retries, MAX_ERROR_BACKOFF_S)
        logger.exception("job %s: unexpected error; published again in %ds", job_id, countdown_s)
        raise self.retry(countdown=countdown_s, exc=exc)
    logger.info("job %s: %s", job_id, attempt.reason)
    if attempt.outcome == Outcome.REQUEUE:
        logger.warning("job %s back to the queue: %s", job_id, attempt.reason)
        raise Reject(attempt.reason, requeue=True)
    if attempt.outcome == Outcome.RETRY:
        logger.warning("job %s: %s; retry in %ds", job_id, attempt.reason, attempt.countdown_s)
        raise self.retry(countdown=attempt.countdown_s)


@app.task(name=names.RUN_CHUNK, bind=True, max_retries=None, typing=False)
def run_chunk(self, *args, **kwargs) -> None:
    """Run the job rows named by the message's arguments (job ids of one bulk batch) and store
    their results, each as it finishes (:func:`weir.worker.chunk.run_chunk_attempt`). Acked once
    every job has a stored outcome or was published again as a ``run_job`` message of its own
    (to the model's queue). Chunks come from the model's bulk queue, whose prefetch window is the
    chunks that fill the worker's engine and one more (``weir.worker.app.BulkLane``), so each
    starts at once. A chunk found in the model queue itself (published there by an earlier
    client) runs on at most half its task threads (``WorkerRuntime.enter_chunk``); one that finds
    half the threads taken is retried after ``CHUNK_WAIT_S`` (an ETA message, which holds no
    thread), so single jobs always find threads free.

    Raises:
        celery.exceptions.Reject: the engine is shutting down or failed, or the database stayed
            unreachable; the message goes back to the queue (its stored jobs are skipped then).
        celery.exceptions.Retry: an unexpected error (after a backoff, as ``run_job``).
    """
    from weir.worker.chunk import parse_job_ids, run_chunk_attempt

    runtime = get_runtime()
    delivery = self.request.delivery_info or {}
    try:
        job_ids = parse_job_ids(args, kwargs)
    except MalformedMessage as exc:
        dead_letter(runtime, body={"args": list(args), "kwargs": kwargs}, reason=str(exc),
                    queue=delivery.get("routing_key"), task=self.name, message_id=self.request.id)
        return
    if not runtime.enter_chunk():  # half the threads hold chunks: wait as an ETA message, holding none
        raise self.retry(countdown=CHUNK_WAIT_S)
    try:
        attempt = run_chunk_attempt(runtime, job_ids, worker=self.request.hostname or "")
    except Exception as exc:  # never ack without stored outcomes: back to the queue, later
        countdown_s = get_exponential_backoff_interval(1, self.request.retries, MAX_ERROR_BACKOFF_S)
        logger.exception("chunk of %d jobs: unexpected error; published again in %ds", len(job_ids), countdown_s)
        raise self.retry(countdown=countdown_s, exc=exc)
    finally:
        runtime.leave_chunk()
    queue = model_queue(runtime.settings)  # a chunk's job alone is a per-job message of the model's queue
    for job_id, countdown_s in attempt.republish:  # before the ack: a crash here redelivers the chunk
        run_job.apply_async(args=[str(job_id)], countdown=countdown_s or None,
                            queue=queue, priority=delivery.get("priority"))
    logger.info("chunk of %d jobs: %s", len(job_ids), attempt.reason)
    if attempt.outcome == Outcome.REQUEUE:
        logger.warning("chunk of %d jobs back to the queue: %s", len(job_ids), attempt.reason)
        raise Reject(attempt.reason, requeue=True)


@app.task(name=names.SWEEP)
def sweep() -> int:
    """Publish again the jobs whose message may be lost (the periodic beat entry); returns how many."""
    from weir.jobs.client import Client

    client = Client(get_settings())
    try:
        return client.sweep()
    finally:
        client.close()
