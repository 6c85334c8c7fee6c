"""The producer's side: validate requests, store them as jobs, publish them, follow their batch.

Order of effects in :meth:`Client.enqueue_batch`: every request is validated (schema, then length
with the model's tokenizer) before anything is written; the batch and job rows are committed; only
then is one Celery message per job published, carrying just the job id, by task name to the
model's queue. A worker that receives a message therefore always finds its row.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Iterable, Optional, Union

from jobs import names, store
from jobs.db import Batch, BatchStatus, Job, make_engine, make_session_factory
from jobs.model_info import PromptChecker
from jobs.schemas import ClassifyRequest, GenerateRequest, JobRequest, parse_request
from weir.config import Settings, get_settings

RequestLike = Union[GenerateRequest, ClassifyRequest, dict[str, Any]]
BatchId = Union[str, uuid.UUID]


class BrokerNotConfigured(RuntimeError):
    """Publishing was asked for but no broker URL is set (``WEIR_BROKER_URL``)."""


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
            metadata: free JSON kept on the batch row.

        Returns:
            The new batch's id.

        Raises:
            pydantic.ValidationError, PromptTooLongError: see :meth:`validate`; nothing was stored.
            ValueError: two requests share a ``custom_id``; nothing was stored.
            BrokerNotConfigured: no broker to publish to; nothing was stored.
        """
        parsed = self.validate(requests)
        if not parsed:
            raise ValueError("enqueue_batch needs at least one request")
        celery_app = self.celery_app
        with self.session_factory.begin() as session:
            batch, jobs = store.create_batch(session, parsed, model=self.model, metadata=metadata)
        self._publish(celery_app, [job.id for job in jobs])
        return batch.id

    def _publish(self, celery_app: Any, job_ids: list[uuid.UUID]) -> None:
        with celery_app.producer_or_acquire() as producer:
            for job_id in job_ids:
                celery_app.send_task(
                    names.RUN_JOB, args=[str(job_id)], queue=self.queue, producer=producer
                )

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
        """Cancel the batch's queued jobs (see :func:`jobs.store.cancel_batch`)."""
        with self.session_factory.begin() as session:
            return BatchProgress.of(store.cancel_batch(session, _as_uuid(batch_id)))

    def close(self) -> None:
        """Release database connections."""
        self.engine.dispose()
