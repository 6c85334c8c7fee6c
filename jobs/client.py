"""The producer's side: validate requests, store them as jobs, publish them, follow their batch.

Order of effects in :meth:`Client.enqueue_batch`: every request is validated (schema, then length
with the model's tokenizer) before anything is written; the batch and job rows are committed; only
then is one Celery message per job published, carrying just the job id, by task name to the
model's queue. A worker that receives a message therefore always finds its row. Jobs whose message
was never published or was lost are published again by :meth:`Client.sweep`.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Iterable, Optional, Union

from jobs import names, store
from jobs.db import Batch, BatchStatus, Job, make_engine, make_session_factory, utcnow
from jobs.model_info import PromptChecker
from jobs.schemas import ClassifyRequest, GenerateRequest, JobRequest, parse_request
from weir.config import Settings, get_settings

logger = logging.getLogger(__name__)

PUBLISH_RETRY_POLICY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2.0}
"""kombu's publish retry policy: a broker that stays unreachable for about 2 s fails the publish."""

RequestLike = Union[GenerateRequest, ClassifyRequest, dict[str, Any]]
BatchId = Union[str, uuid.UUID]


class BrokerNotConfigured(RuntimeError):
    """Publishing was asked for but no broker URL is set (``WEIR_BROKER_URL``)."""


class PublishError(RuntimeError):
    """The batch is stored but some of its messages could not be published.

    The unpublished jobs stay ``queued`` with ``published_at`` null; :meth:`Client.sweep` (run by
    every ``weir worker --beat`` and by ``weir sweep``) publishes them once the broker is back.

    Attributes:
        batch_id: the stored batch (None for a sweep).
        num_unpublished: how many of its jobs have no message yet.
    """

    def __init__(self, batch_id: Optional[uuid.UUID], num_unpublished: int, cause: BaseException) -> None:
        stored = f"batch {batch_id} is stored but " if batch_id is not None else ""
        super().__init__(
            f"{stored}{num_unpublished} jobs were not published ({type(cause).__name__}: {cause}); "
            "`weir sweep` publishes them once the broker answers"
        )
        self.batch_id = batch_id
        self.num_unpublished = num_unpublished


@dataclass(frozen=True)
class BatchProgress:
    """A snapshot of a batch: its status and how many of its jobs ended each way."""

    id: uuid.UUID
    status: BatchStatus
    model: str
    num_jobs: int
    num_succeeded: int
    num_failed: int
    num_cancelled: int
    created_at: datetime
    started_at: Optional[datetime]
    finished_at: Optional[datetime]
    metadata: dict[str, Any]

    @property
    def num_finished(self) -> int:
        return self.num_succeeded + self.num_failed + self.num_cancelled

    @classmethod
    def of(cls, batch: Batch) -> "BatchProgress":
        return cls(
            id=batch.id,
            status=batch.status,
            model=batch.model,
            num_jobs=batch.num_jobs,
            num_succeeded=batch.num_succeeded,
            num_failed=batch.num_failed,
            num_cancelled=batch.num_cancelled,
            created_at=batch.created_at,
            started_at=batch.started_at,
            finished_at=batch.finished_at,
            metadata=dict(batch.meta),
        )


@dataclass(frozen=True)
class JobRef:
    """Where one enqueued job can be found."""

    job_id: uuid.UUID
    batch_id: uuid.UUID


def _as_uuid(value: BatchId) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


class Client:
    """Enqueues jobs for one model and reads their results back.

    Owns a database engine and session factory for ``settings.database``, a Celery app used only
    to publish (``send_task``), and, lazily, the model's tokenizer for length checks.

    Args:
        settings: weir settings; default :func:`weir.config.get_settings`.
        celery_app: publish through this app instead of one built from ``WEIR_BROKER_URL``
            (the embedded mode hands in its in-process app).
        prompt_checker: length checks with this instead of loading the model's tokenizer (the
            embedded mode hands in the engine's).
    """

    def __init__(
        self,
        settings: Optional[Settings] = None,
        *,
        celery_app: Any = None,
        prompt_checker: Optional[PromptChecker] = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.model = names.model_name(self.settings.engine.model)
        self.queue = names.queue_for_model(self.settings.engine.model, self.settings.worker.queue)
        self.engine = make_engine(self.settings.database.url())
        self.session_factory = make_session_factory(self.engine)
        self._celery_app = celery_app
        if prompt_checker is not None:
            self.prompt_checker = prompt_checker

    @cached_property
    def prompt_checker(self) -> PromptChecker:
        """The model's tokenizer and ``max_model_len``, loaded on first use."""
        engine = self.settings.engine
        return PromptChecker.for_model(engine.model, engine.tokenizer, engine.max_model_len)

    @property
    def celery_app(self) -> Any:
        if self._celery_app is None:
            broker_url = self.settings.worker.broker_url
            if not broker_url:
                raise BrokerNotConfigured("no broker: set WEIR_BROKER_URL (e.g. redis://127.0.0.1:6379/0)")
            from celery import Celery

            self._celery_app = Celery("weir-client", broker=broker_url, set_as_current=False)
            self._celery_app.conf.broker_transport_options = {
                "visibility_timeout": self.settings.worker.visibility_timeout_s
            }
            self._celery_app.conf.broker_connection_timeout = 2.0
        return self._celery_app

    def validate(self, requests: Iterable[RequestLike]) -> list[JobRequest]:
        """Parse and length-check requests; nothing is stored.

        Raises:
            pydantic.ValidationError: a request is malformed (the error names the field).
            jobs.model_info.PromptTooLongError: a prompt does not fit in ``max_model_len``.
        """
        parsed = [parse_request(r) for r in requests]
        for request in parsed:
            self.prompt_checker.check(request)
        return parsed

    def enqueue_batch(
        self, requests: Iterable[RequestLike], *, metadata: Optional[dict[str, Any]] = None
    ) -> uuid.UUID:
        """Validate, store and publish a batch of requests.

        Args:
            requests: ``GenerateRequest``/``ClassifyRequest`` models, or dicts with a ``kind``.
            metadata: free JSON kept on the batch row (see :func:`jobs.schemas.check_json`).

        Returns:
            The new batch's id.

        Raises:
            pydantic.ValidationError, PromptTooLongError: see :meth:`validate`; nothing was stored.
            ValueError: two requests share a ``custom_id``, or ``metadata`` is not plain JSON
                (the message names the field); nothing was stored.
            BrokerNotConfigured: no broker to publish to; nothing was stored.
            PublishError: the rows are stored but the broker refused some messages; the sweeper
                publishes those later.
        """
        parsed = self.validate(requests)
        if not parsed:
            raise ValueError("enqueue_batch needs at least one request")
        celery_app = self.celery_app
        with self.session_factory.begin() as session:
            batch, jobs = store.create_batch(session, parsed, model=self.model, metadata=metadata)
        self._publish_or_mark(celery_app, [job.id for job in jobs], batch.id)
        return batch.id

    def _publish_or_mark(
        self, celery_app: Any, job_ids: list[uuid.UUID], batch_id: Optional[uuid.UUID]
    ) -> None:
        num_published = 0
        try:
            with celery_app.producer_or_acquire() as producer:
                for job_id in job_ids:
                    celery_app.send_task(
                        names.RUN_JOB, args=[str(job_id)], queue=self.queue, producer=producer,
                        retry=True, retry_policy=PUBLISH_RETRY_POLICY,
                    )
                    num_published += 1
        except Exception as exc:
            unpublished = job_ids[num_published:]
            try:
                with self.session_factory.begin() as session:
                    store.mark_published(session, unpublished, None)
            except Exception:  # the sweeper still finds them, one deadline later
                logger.exception("batch %s: cannot mark %d jobs unpublished", batch_id, len(unpublished))
            raise PublishError(batch_id, len(unpublished), exc) from exc

    def sweep(self, older_than_s: Optional[float] = None, *, limit: int = 10_000) -> int:
        """Publish again the jobs of this client's model whose message may be lost.

        Covers a Redis restarted without persistence, a publish that failed after the rows were
        committed, a message taken by a worker killed before the broker recorded it as unacked,
        and a running job whose worker died and whose message is gone. Taken: jobs ``running``
        whose latest claim and latest publish are more than ``older_than_s`` old, and, only while
        the model's queue holds no waiting message (a backlog is not a loss), jobs ``queued`` and
        never published or last published that long ago (see
        :func:`jobs.store.take_jobs_to_publish`). A job published twice is still run and stored
        once, so sweeping again, or while the old message lives, is harmless.

        Args:
            older_than_s: the deadline in seconds; default ``WEIR_SWEEP_AFTER_S`` (which defaults
                to the visibility timeout).
            limit: the most jobs published by one call.

        Returns:
            The number of jobs published.

        Raises:
            BrokerNotConfigured: no broker URL.
            PublishError: the broker refused the messages (the jobs are marked unpublished).
        """
        from datetime import timedelta

        deadline_s = self.settings.worker.sweep_deadline_s if older_than_s is None else older_than_s
        celery_app = self.celery_app
        queue_is_empty = self.num_waiting_messages() == 0
        with self.session_factory.begin() as session:
            job_ids = store.take_jobs_to_publish(
                session, model=self.model, older_than=utcnow() - timedelta(seconds=deadline_s), limit=limit,
                include_queued=queue_is_empty,
            )
        if job_ids:
            self._publish_or_mark(celery_app, job_ids, batch_id=None)
            logger.warning("sweep: published %d jobs again (no message seen for %gs)", len(job_ids), deadline_s)
        return len(job_ids)

    def num_waiting_messages(self) -> int:
        """Messages waiting in the model's queue (not counting those workers hold unacked).

        Raises:
            BrokerNotConfigured: no broker URL.
        """
        with self.celery_app.connection_for_read() as connection:
            try:
                return connection.default_channel.queue_declare(self.queue, passive=True).message_count
            except connection.channel_errors:  # Redis keeps no key for an empty queue
                return 0

    def enqueue_generate(self, prompt: Any, **fields: Any) -> JobRef:
        """Enqueue one generation job (a batch of one). ``fields``: the rest of ``GenerateRequest``."""
        batch_id = self.enqueue_batch([GenerateRequest(prompt=prompt, **fields)])
        return JobRef(job_id=self.jobs(batch_id)[0].id, batch_id=batch_id)

    def enqueue_classify(self, prompt: Any, labels: list[str], **fields: Any) -> JobRef:
        """Enqueue one classification job (a batch of one). ``fields``: the rest of ``ClassifyRequest``."""
        batch_id = self.enqueue_batch([ClassifyRequest(prompt=prompt, labels=labels, **fields)])
        return JobRef(job_id=self.jobs(batch_id)[0].id, batch_id=batch_id)

    def batch_status(self, batch_id: BatchId) -> BatchProgress:
        """The batch's current status and counts.

        Raises:
            LookupError: no such batch.
        """
        with self.session_factory() as session:
            return BatchProgress.of(store.get_batch(session, _as_uuid(batch_id)))

    def wait(
        self,
        batch_id: BatchId,
        timeout_s: Optional[float] = None,
        *,
        progress: Any = None,
        poll_interval_s: float = 0.5,
    ) -> BatchProgress:
        """Poll until the batch is finished (completed, failed or cancelled).

        Args:
            timeout_s: give up after this many seconds; None waits forever.
            progress: a tqdm bar (or anything with ``total``, ``n``, ``refresh()``) kept at the
                number of finished jobs.

        Returns:
            The final snapshot.

        Raises:
            TimeoutError: the batch is still running after ``timeout_s``.
            LookupError: no such batch.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            snapshot = self.batch_status(batch_id)
            if progress is not None:
                progress.total = snapshot.num_jobs
                progress.n = snapshot.num_finished
                progress.refresh()
            if snapshot.status.is_finished:
                return snapshot
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"batch {batch_id} still {snapshot.status.value} after {timeout_s}s: "
                    f"{snapshot.num_finished}/{snapshot.num_jobs} jobs finished"
                )
            time.sleep(poll_interval_s)

    def jobs(self, batch_id: BatchId) -> list[Job]:
        """The batch's job rows in submission order (detached, readable after the call)."""
        with self.session_factory() as session:
            return store.list_jobs(session, _as_uuid(batch_id))

    def results(self, batch_id: BatchId) -> list[dict[str, Any]]:
        """One dict per job, in submission order: ids, status, output or label, token counts, error."""
        return [
            {
                "job_id": str(job.id),
                "custom_id": job.custom_id,
                "kind": job.kind.value,
                "status": job.status.value,
                "attempts": job.attempts,
                "output_text": job.output_text,
                "label": job.label,
                "label_probs": job.label_probs,
                "finish_reason": job.finish_reason,
                "num_prompt_tokens": job.num_prompt_tokens,
                "num_completion_tokens": job.num_completion_tokens,
                "num_cached_tokens": job.num_cached_tokens,
                "error": job.error,
                "metadata": job.request.get("metadata", {}),
            }
            for job in self.jobs(batch_id)
        ]

    def cancel(self, batch_id: BatchId) -> BatchProgress:
        """Cancel the batch's queued and running jobs (see :func:`jobs.store.cancel_batch`).

        Raises:
            LookupError: no such batch.
        """
        with self.session_factory.begin() as session:
            return BatchProgress.of(store.cancel_batch(session, _as_uuid(batch_id)))

    def cancel_job(self, job_id: BatchId) -> Job:
        """Cancel one queued or running job (see :func:`jobs.store.cancel_job`).

        Raises:
            LookupError: no such job.
        """
        with self.session_factory.begin() as session:
            return store.cancel_job(session, _as_uuid(job_id))

    def close(self) -> None:
        """Release database connections."""
        self.engine.dispose()
