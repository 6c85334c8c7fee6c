"""Celery tasks: thin adapters between a queue message, the engine and the results database.

``run_job`` hands one delivery to :func:`worker.attempt.run_attempt` (claim, run, store) and maps
its outcome onto Celery: return (ack), ``Reject(requeue=True)`` (back to the queue) or
``retry`` (published again after a backoff). Logic lives in ``worker.attempt``, ``jobs.store``
(database), ``worker.runtime`` (engine) and ``jobs.catalog`` (enrichment batches).
"""

from __future__ import annotations

import logging

from celery.exceptions import Reject

from jobs import names
from weir.config import get_settings
from worker.app import app
from worker.attempt import MalformedMessage, Outcome, dead_letter, parse_job_id, run_attempt
from worker.runtime import get_runtime

logger = logging.getLogger(__name__)


@app.task(name=names.RUN_JOB, bind=True, max_retries=None, typing=False)
def run_job(self, *args, **kwargs) -> None:
    """Run the job row named by the message's one argument (a job id) and store its result.

    A message with other arguments is kept in ``dead_letters`` and acked; a finished, cancelled
    or unknown job is skipped.

    Raises:
        celery.exceptions.Reject: the engine is shutting down or the database stayed unreachable;
            the message goes back to the queue.
        celery.exceptions.Retry: the attempt timed out and the job has attempts left.
    """
    runtime = get_runtime()
    try:
        job_id = parse_job_id(args, kwargs)
    except MalformedMessage as exc:
        dead_letter(runtime, body={"args": list(args), "kwargs": kwargs}, reason=str(exc),
                    queue=(self.request.delivery_info or {}).get("routing_key"), task=self.name,
                    message_id=self.request.id)
        return
    attempt = run_attempt(runtime, job_id, worker=self.request.hostname or "")
    logger.info("job %s: %s", job_id, attempt.reason)
    if attempt.outcome == Outcome.REQUEUE:
        logger.warning("job %s back to the queue: %s", job_id, attempt.reason)
        raise Reject(attempt.reason, requeue=True)
    if attempt.outcome == Outcome.RETRY:
        logger.warning("job %s: %s; retry in %ds", job_id, attempt.reason, attempt.countdown_s)
        raise self.retry(countdown=attempt.countdown_s)


@app.task(name=names.SWEEP)
def sweep() -> int:
    """Publish again the jobs whose message may be lost (the periodic beat entry); returns how many."""
    from jobs.client import Client

    client = Client(get_settings())
    try:
        return client.sweep()
    finally:
        client.close()


@app.task(name=names.ENRICH_CATALOG)
def enrich_catalog(catalog_path: str) -> None:
    """Enqueue one enrichment batch for the catalog at ``catalog_path`` (the nightly beat entry)."""
    from jobs.catalog import enqueue_catalog, read_catalog
    from jobs.client import Client

    catalog = read_catalog(catalog_path)
    client = Client(get_settings())
    try:
        batch_id = enqueue_catalog(client, catalog)
    finally:
        client.close()
    logger.info("catalog %s: enrichment batch %s enqueued", catalog_path, batch_id)
