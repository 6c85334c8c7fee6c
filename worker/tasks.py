"""Celery tasks: thin adapters between a queue message, the engine and the results database.

Each task: load and claim the job row, run it through the engine, upsert the result (and the
product's enrichment row), return so Celery acknowledges the message. Logic lives in
``jobs.store`` (database), ``worker.runtime`` (engine) and ``jobs.catalog`` (enrichment batches).
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from jobs import names, store
from weir.config import get_settings
from worker.app import app
from worker.runtime import EngineStopping, get_runtime

logger = logging.getLogger(__name__)

MAX_RETRY_DELAY_S = 60


def _is_transient(exc: Exception) -> bool:
    """Database errors worth retrying: lost connections, lock timeouts, deadlocks, busy SQLite."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


@app.task(name=names.RUN_JOB, bind=True, max_retries=get_settings().worker.max_retries)
def run_job(self, job_id: str) -> None:
    """Run the job row ``job_id`` and store its result; a finished or unknown job is skipped.

    Raises:
        celery.exceptions.Retry: a transient database error; retried with exponential backoff.
        celery.exceptions.Reject: the engine is shutting down; the message goes back to the queue.
    """
    runtime = get_runtime()
    try:
        with runtime.session_factory.begin() as session:
            job = store.claim_job(session, uuid.UUID(job_id))
        if job is None:
            logger.info("job %s: nothing to run (finished, cancelled or unknown)", job_id)
            return
        result = runtime.run(job)
        with runtime.session_factory.begin() as session:
            if store.record_result(session, job, result):
                store.record_enrichment(session, job, result, model=runtime.model_name)
    except EngineStopping as exc:
        from celery.exceptions import Reject

        raise Reject(str(exc), requeue=True) from exc
    except Exception as exc:
        if not _is_transient(exc):
            raise
        delay_s = min(2**self.request.retries, MAX_RETRY_DELAY_S)
        logger.warning("job %s: database error, retry in %ds: %s", job_id, delay_s, exc)
        raise self.retry(exc=exc, countdown=delay_s)


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
