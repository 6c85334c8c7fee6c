"""Shared pieces of the jobs/ and worker/ tests: service URLs, a fresh database, a tiny chat model."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import pytest

from weir.worker.testing import service_urls

if TYPE_CHECKING:  # the store's packages are imported where used: the GPU machine's engine and
    # kernel tests import this module without SQLAlchemy or pydantic (bench/gpu.sh --small)
    from sqlalchemy.orm import Session

    from weir.jobs.db import Batch, Job
    from weir.jobs.results import JobResult
    from weir.jobs.schemas import JobRequest

# Test-only knobs (the project's own settings come from weir.config).
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()

_tiny_model_dir: Optional[str] = None


def _missing_service(message: str) -> None:
    """Skip on a developer machine without the service; in CI (``CI`` set) a missing service is
    a failure, so a green run always means the integration tests ran."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new ``weir_test_<random>`` database migrated to head, dropped afterwards; skips the
    test when no Postgres server answers at ``WEIR_TEST_POSTGRES_URL``."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from weir import migrations
    from weir.jobs.db import make_engine
    from weir.jobs.testing import temporary_postgres_database

    probe = make_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    try:
        with probe.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        _missing_service(f"no Postgres at {POSTGRES_ADMIN_URL}: {exc.orig}")
    finally:
        probe.dispose()
    with temporary_postgres_database(POSTGRES_ADMIN_URL) as url:
        migrations.upgrade(url)
        yield url


def redis_or_skip() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as exc:
        _missing_service(f"no Redis at {REDIS_URL}: {exc}")
    return REDIS_URL


def tiny_chat_model_dir(tmp_path_factory) -> str:
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and chat template
    (:func:`weir.jobs.testing.save_tiny_chat_model`), saved once per test process."""
    global _tiny_model_dir
    if _tiny_model_dir is None:
        from weir.jobs.testing import save_tiny_chat_model

        _tiny_model_dir = save_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat-llama")))
    return _tiny_model_dir


# The one-job forms of the store's group operations, which only tests use.


def create_batch(
    session: Session,
    requests: Sequence[JobRequest],
    *,
    model: str,
    metadata: Optional[dict[str, Any]] = None,
) -> tuple[Batch, list[Job]]:
    """Add a queued batch and one queued job per request in this session (flushed, not committed).

    The small-batch form of what :meth:`weir.jobs.client.Client.enqueue_batch` does chunk by chunk:
    :func:`weir.jobs.batches.begin_batch`, :func:`~weir.jobs.batches.add_jobs`, :func:`~weir.jobs.batches.queue_batch`.

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
    from weir.jobs.batches import add_jobs, begin_batch, list_jobs, queue_batch
    from weir.jobs.db import utcnow

    batch = begin_batch(session, model=model, metadata=metadata)
    add_jobs(session, batch.id, requests, first_index=0, model=model, published_at=utcnow())
    queue_batch(session, batch.id, len(requests))
    return batch, list_jobs(session, batch.id)


def claim_job(
    session: Session,
    job_id: uuid.UUID,
    *,
    worker: Optional[str] = None,
    max_attempts: Optional[int] = None,
    lease_s: float = 600.0,
) -> Optional[Job]:
    """:func:`weir.jobs.claims.claim_jobs` for one job: the job as claimed, or None when there is nothing to run
    (finished, out of attempts, held under a live lease by another claim, or unknown)."""
    from weir.jobs.claims import claim_jobs

    claim = claim_jobs(session, [job_id], worker=worker, lease_s=lease_s, max_attempts=max_attempts)[job_id]
    return claim.job


def record_result(session: Session, job: Job, result: JobResult) -> bool:
    """:func:`weir.jobs.results.record_results` for one job. Returns True when the row took this result."""
    from weir.jobs.results import record_results

    return job.id in record_results(session, [(job, result)])
