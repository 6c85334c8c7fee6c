"""The producer's side: validate requests, store them as jobs, publish them, follow their batch.

Order of effects in :meth:`Client.enqueue_batch`, which streams its requests with bounded memory:
the broker is reached first (a wrong broker URL stores nothing); the batch row is committed as
``validating``; requests are validated (schema, then length with the model's tokenizer) and
inserted chunk by chunk, each chunk in its own transaction; any error there deletes the batch and
its jobs. Once every job is stored, one transaction makes the batch ``queued``; only then are its
Celery messages published, carrying just job ids, by task name: a bulk batch's in chunks to the
model's bulk queue, any other one message per job to its interactive queue
(see :mod:`weir.jobs.publisher`). A worker that receives a message therefore always finds its row and
never sees a half-stored batch (nor does the sweeper: both pass over ``validating`` batches). Jobs
whose message was never published or was lost are published again by :meth:`Client.sweep`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from kombu.exceptions import OperationalError
from kombu.utils.url import maybe_sanitize_url
from pydantic import ConfigDict, TypeAdapter, ValidationError
from sqlalchemy.exc import IntegrityError

from weir.jobs import applications, batches, counters, names, outbox
from weir.jobs.db import Batch, BatchStatus, Job, engine_for, make_session_factory, utcnow
from weir.jobs.model_info import PromptChecker
from weir.jobs.publisher import JobPublisher
from weir.jobs.retry import retry_on_conflict
from weir.jobs.schemas import (
    INTERACTIVE_PRIORITY, SAMPLING_FIELDS, ClassifyRequest, GenerateRequest, JobRequest, Priority,
    check_json, parse_request,
)
from weir.config import Settings, get_settings

logger = logging.getLogger(__name__)

PRIORITY = TypeAdapter(Priority, config=ConfigDict(title="priority"))

STALE_VALIDATING_S = 3600
"""A batch still ``validating`` this long after its creation lost its producer; the sweeper deletes it."""

PUBLISH_ALLOWANCE_S = 600
"""How long a producer may take to publish a stored batch (a million jobs take about 100 s)."""

PUBLISH_RETRY_POLICY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2.0}
"""kombu's publish retry policy: a broker that stays unreachable for about 2 s fails the publish."""

DEFAULT_CHUNK_SIZE = 5_000
"""Requests validated and inserted per transaction, and messages per broker round trip."""

ANALYZE_AFTER_NUM_JOBS = 5_000
"""A batch of at least this many jobs refreshes the planner's statistics of ``jobs`` once stored
(:func:`weir.jobs.batches.analyze_jobs`), so the workers' claims look jobs up by id from the start."""

DEFAULT_PAGE_SIZE = 1_000
"""Job rows per read when results are streamed."""

BROKER_CHECK_TIMEOUT_S = 5.0

RequestLike = Union[GenerateRequest, ClassifyRequest, dict[str, Any]]
BatchId = Union[str, uuid.UUID]


class BrokerNotConfigured(RuntimeError):
    """Publishing was asked for but no broker URL is set (``WEIR_BROKER_URL``)."""


class BrokerUnreachable(RuntimeError):
    """The broker did not answer the connection check made before anything is stored."""


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


def _sampling_params(request: dict[str, Any]) -> dict[str, Any]:
    """A stored generation request's sampling fields (a field it lacks, stored before it
    existed, is left out) and its ``response_format``."""
    keys = (*SAMPLING_FIELDS, "response_format")
    return {key: request[key] for key in keys if key in request}


def _as_uuid(value: BatchId) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


@dataclass
class EnqueueTimings:
    """Where one :meth:`Client.enqueue_batch` spent its time, in seconds (logged with the record
    as ``enqueue_timings``). Time spent producing the caller's requests is in none of them."""

    batch_id: uuid.UUID
    num_jobs: int = 0
    validate_s: float = 0.0
    """Parsing and length checks."""
    store_s: float = 0.0
    """Inserting the jobs."""
    publish_s: float = 0.0
    """Stamping and publishing the messages."""


_NO_REQUEST = object()


def _parse(request: RequestLike, index: int) -> JobRequest:
    """:func:`parse_request`; a ValidationError gets a note naming the request's batch index."""
    try:
        return parse_request(request)
    except ValidationError as exc:
        exc.add_note(f"request at batch index {index}")
        raise


def broker_priority(priority: int) -> int:
    """The message priority of a job of ``priority``: the same number clamped to kombu's 0 to 9
    (on Redis 0 is polled first, as in the engine lower runs first)."""
    return max(0, min(9, priority))


def num_waiting_messages(celery_app: Any, queue: str, timeout_s: Optional[float] = None) -> int:
    """Messages waiting in ``queue`` on ``celery_app``'s broker (not counting those workers hold
    unacked).

    Args:
        timeout_s: give the broker connection one try of this long (None: the app's own retries).

    Raises:
        kombu.exceptions.OperationalError: with ``timeout_s``, the broker cannot be reached.
    """
    with celery_app.connection_for_read() as connection:
        if timeout_s is not None:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
        try:
            return connection.default_channel.queue_declare(queue, passive=True).message_count
        except connection.channel_errors:  # Redis keeps no key for an empty queue
            return 0


def _check_broker(celery_app: Any) -> None:
    """Open and close one broker connection.

    Raises:
        BrokerUnreachable: no answer (the one-line message names the broker, password hidden).
    """
    with celery_app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2,
                                         timeout=BROKER_CHECK_TIMEOUT_S)
        except (OperationalError, *connection.connection_errors) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise BrokerUnreachable(
                f"cannot reach the broker at {maybe_sanitize_url(connection.as_uri(include_password=True))} "
                f"({reason}); nothing was stored"
            ) from None


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
        self.engine = engine_for(self.settings.database)
        self.session_factory = make_session_factory(self.engine)
        self.batch_channel = batches.BatchChannel(self.engine)
        """Wakes :meth:`wait` when its batch changes (one listening connection, from the first wait)."""
        self._celery_app = celery_app
        self._embedded: Optional[contextlib.ExitStack] = None
        if prompt_checker is not None:
            self.prompt_checker = prompt_checker

    @cached_property
    def prompt_checker(self) -> PromptChecker:
        """The model's tokenizer, ``max_model_len``, vocabulary size and ``max_logprobs``, loaded
        on first use."""
        engine = self.settings.engine
        return PromptChecker.for_model(engine.model, engine.tokenizer, engine.max_model_len, engine.max_logprobs)

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
            # Celery's setting, off by default as Celery's: each event is one more Redis publish
            self._celery_app.conf.task_send_sent_event = self.settings.worker.task_send_sent_event
        return self._celery_app

    def _publishing_app(self) -> Any:
        """The app to publish through; with no broker URL and no app handed in, the in-process
        worker's, started first (:meth:`_start_embedded`)."""
        if self._celery_app is None and not self.settings.worker.broker_url:
            self._start_embedded()
        return self.celery_app

    def _start_embedded(self) -> None:
        """The embedded mode of ``weir enrich``, for a client with no ``WEIR_BROKER_URL``: migrate a
        SQLite database, load the model and run the same tasks on an in-process worker and broker
        (:func:`weir.worker.embedded.embedded_worker`) until :meth:`close`. Its jobs run only while
        this process lives. The engine's step loop runs on a thread of this process
        (``WEIR_ENGINE_MULTIPROCESSING=false``): a process of its own would be spawned by running
        the caller's script again, which a script without an ``if __name__ == "__main__":`` guard
        cannot survive."""
        from weir import migrations
        from weir.worker.app import app
        from weir.worker.embedded import embedded_worker

        url = self.settings.database.url()
        if url.startswith("sqlite"):
            migrations.upgrade(url)
        logger.warning("no WEIR_BROKER_URL: running the jobs on an in-process worker (loading model %s); "
                       "results in %s", self.model, maybe_sanitize_url(url))
        with contextlib.ExitStack() as stack:
            in_process = self.settings.worker.model_copy(update={"engine_multiprocessing": False})
            runtime = stack.enter_context(embedded_worker(app, self.settings.model_copy(update={"worker": in_process})))
            if "prompt_checker" not in self.__dict__:  # the engine's tokenizer, not a second copy
                processor = runtime.front.processor
                self.prompt_checker = PromptChecker(processor.tokenizer, processor.max_model_len,
                                                    vocab_size=processor.vocab_size,
                                                    max_logprobs=self.settings.engine.max_logprobs)
            self._embedded = stack.pop_all()
        self._celery_app = app

    def validate(self, requests: Iterable[RequestLike]) -> list[JobRequest]:
        """Parse and length-check requests; nothing is stored.

        Raises:
            pydantic.ValidationError: a request is malformed (the error names the field; a note
                names the request's index).
            weir.jobs.model_info.PromptTooLongError: a prompt does not fit in ``max_model_len``.
            weir.jobs.model_info.EngineLimitError: ``logprobs``/``prompt_logprobs`` above
                ``max_logprobs``, or ``stop_token_ids`` outside the model's vocabulary.
        """
        parsed = [_parse(r, i) for i, r in enumerate(requests)]
        self.prompt_checker.check_batch(parsed)
        return parsed

    def enqueue_batch(
        self,
        requests: Iterable[RequestLike],
        *,
        metadata: Optional[dict[str, Any]] = None,
        idempotency_key: Optional[str] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        priority: Optional[int] = None,
    ) -> uuid.UUID:
        """Validate, store and publish a batch of requests, streaming: memory is bounded by
        ``chunk_size``, not by the batch's length (on 2 cores, 1,000,000 short jobs in about 3
        minutes, 5,700 jobs/s, at a peak RSS of 450 MB of which 425 MB is the loaded tokenizer;
        see ``bench/enqueue.py``).

        Order of effects (the module docstring says why):

        1. the broker is reached (one connection check);
        2. the batch row is committed, ``validating``;
        3. requests are read ``chunk_size`` at a time: parsed, checked against the engine's limits
           (length in one tokenizer call, ``max_logprobs``, the vocabulary), and inserted in their own transaction;
        4. one transaction sets ``num_jobs`` and makes the batch ``queued`` (a batch of
           :data:`ANALYZE_AFTER_NUM_JOBS` or more then refreshes the planner's statistics of
           ``jobs``, :func:`weir.jobs.batches.analyze_jobs`);
        5. one message per job is published, in batch-index order, ``chunk_size`` messages per
           broker round trip on Redis; each chunk's ``published_at`` is stamped just before it goes.

        An error in steps 2 to 4 (or an interrupt) deletes the batch and its jobs and is raised
        again: nothing is left and nothing was published.

        Args:
            requests: ``GenerateRequest``/``ClassifyRequest`` models, or dicts with a ``kind``;
                any iterable, read once (a generator is read lazily, ``chunk_size`` at a time).
            metadata: free JSON kept on the batch row (see :func:`weir.jobs.schemas.check_json`).
            idempotency_key: at most 300 characters. When a batch with this key exists (even one
                another producer is still storing, or one left ``validating`` by a producer that
                died), its id is returned and nothing is stored or published; of ``requests``
                only the first is read.
            chunk_size: requests per transaction and messages per round trip (at least 1).
            priority: every job's priority (vLLM's meaning: lower runs first), stored in its
                request and given to the engine; None keeps each request's own (default
                :data:`~weir.jobs.schemas.INTERACTIVE_PRIORITY`, 0). A batch above priority 0
                (:data:`~weir.jobs.schemas.BULK_PRIORITY`, the catalog job's, is 9) is published
                to the model's bulk queue (:func:`weir.jobs.names.bulk_queue`),
                ``WEIR_BULK_CHUNK_SIZE`` jobs to a message, at the
                broker's priority level :func:`broker_priority` of it; any other batch one
                message per job to the model's interactive queue
                (:func:`weir.jobs.names.interactive_queue`), which workers consume in a
                prefetch window of its own, so a single job never waits behind bulk messages.

        Returns:
            The batch's id.

        Raises:
            ValueError: no request, ``chunk_size`` below 1, two requests share a ``custom_id``
                (the message names it and the second one's batch index), or ``metadata`` is not
                plain JSON (the message names the field); nothing was stored.
            pydantic.ValidationError: a request is malformed (the error names the field, a note
                names its batch index), or ``priority`` is not a 32-bit integer (checked as a
                request's :data:`~weir.jobs.schemas.Priority`); nothing was stored.
            PromptTooLongError: a prompt does not fit (the message names the request's
                ``custom_id`` and batch index); nothing was stored.
            EngineLimitError: ``logprobs``/``prompt_logprobs`` above ``WEIR_MAX_LOGPROBS``, or
                ``stop_token_ids`` outside the model's vocabulary (the message names the field,
                the ``custom_id`` and batch index); nothing was stored.
            BrokerUnreachable: no broker to publish to; nothing was stored.
            PublishError: the batch is stored but the broker failed part way; the jobs not
                published have ``published_at`` null and the sweeper publishes them.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        if priority is not None:
            PRIORITY.validate_python(priority)
        check_json(dict(metadata or {}), "batch metadata")
        remaining = iter(requests)
        first = next(remaining, _NO_REQUEST)
        if first is _NO_REQUEST:
            raise ValueError("enqueue_batch needs at least one request")
        celery_app = self._publishing_app()
        if idempotency_key is not None and not (isinstance(idempotency_key, str) and 0 < len(idempotency_key) <= 300):
            raise ValueError("idempotency_key must be a string of 1 to 300 characters")
        _check_broker(celery_app)
        batch_id, is_new = self._begin_batch(metadata, idempotency_key)
        if not is_new:
            logger.info("batch %s already holds idempotency key %r: nothing enqueued", batch_id, idempotency_key)
            return batch_id
        timings = EnqueueTimings(batch_id)
        try:
            self._store_jobs(batch_id, itertools.chain([first], remaining), chunk_size, timings, priority)
            with self.session_factory.begin() as session:
                batches.queue_batch(session, batch_id, timings.num_jobs)
        except BaseException:
            self._delete_batch(batch_id)
            raise
        if timings.num_jobs >= ANALYZE_AFTER_NUM_JOBS:
            try:
                with self.session_factory.begin() as session:
                    batches.analyze_jobs(session)
            except Exception as exc:  # the batch is stored; claims are only slower until autovacuum runs
                logger.warning("batch %s: cannot refresh the statistics of jobs (ANALYZE): %s", batch_id, exc)
        started = time.perf_counter()
        try:
            bulk = priority is not None and priority > INTERACTIVE_PRIORITY
            self._publish_batch(celery_app, batch_id, timings.num_jobs, chunk_size,
                                names.bulk_queue(self.queue) if bulk else names.interactive_queue(self.queue),
                                broker_priority(INTERACTIVE_PRIORITY if priority is None else priority),
                                self.settings.worker.bulk_chunk_size if bulk else 1)
        finally:
            timings.publish_s = time.perf_counter() - started
            logger.info(
                "batch %s: %d jobs validated in %.1fs, stored in %.1fs, published in %.1fs", batch_id,
                timings.num_jobs, timings.validate_s, timings.store_s, timings.publish_s,
                extra={"enqueue_timings": timings},
            )
        return batch_id

    def _begin_batch(
        self, metadata: Optional[dict[str, Any]], idempotency_key: Optional[str]
    ) -> tuple[uuid.UUID, bool]:
        """Commit a new ``validating`` batch: (its id, True); or (the id of the batch that already
        holds ``idempotency_key``, False)."""

        def insert() -> uuid.UUID:
            with self.session_factory.begin() as session:
                return batches.begin_batch(session, model=self.model, metadata=metadata,
                                           idempotency_key=idempotency_key).id

        try:
            return insert(), True
        except IntegrityError:
            if idempotency_key is None:
                raise
        with self.session_factory() as session:
            existing = batches.batch_with_key(session, idempotency_key)
        if existing is not None:
            return existing.id, False
        return insert(), True  # its producer failed and deleted it since: the key is free again

    def _store_jobs(self, batch_id: uuid.UUID, requests: Iterator[RequestLike], chunk_size: int,
                    timings: "EnqueueTimings", priority: Optional[int] = None) -> None:
        """Validate and insert ``requests`` chunk by chunk, one transaction per chunk; counts them
        in ``timings.num_jobs``. ``priority``, when given, replaces each request's."""
        while chunk := list(itertools.islice(requests, chunk_size)):
            started = time.perf_counter()
            first_index = timings.num_jobs
            parsed = [_parse(r, first_index + i) for i, r in enumerate(chunk)]
            if priority is not None:
                parsed = [r.model_copy(update={"priority": priority}) for r in parsed]
            self.prompt_checker.check_batch(parsed, first_index)
            validated = time.perf_counter()
            with self.session_factory.begin() as session:
                # published_at: the latest time its message will have been published. No
                # sweeper takes a job of a validating batch, each chunk is stamped again just
                # before its messages go, and until then the sweeper (which takes queued jobs
                # published before the queue's oldest message) leaves the rest alone; should
                # this producer die, they are swept once that time has passed.
                batches.add_jobs(session, batch_id, parsed, first_index=first_index, model=self.model,
                                 published_at=utcnow() + timedelta(seconds=PUBLISH_ALLOWANCE_S))
            timings.num_jobs += len(parsed)
            timings.validate_s += validated - started
            timings.store_s += time.perf_counter() - validated

    def _delete_batch(self, batch_id: uuid.UUID) -> None:
        try:
            with self.session_factory.begin() as session:
                batches.delete_batch(session, batch_id)
        except Exception:  # never published, so never run; the original error matters more
            logger.exception("batch %s: cannot delete the batch left validating", batch_id)

    def _publish_batch(self, celery_app: Any, batch_id: uuid.UUID, num_jobs: int, chunk_size: int,
                       queue: str, message_priority: int = 0, jobs_per_message: int = 1) -> None:
        """Publish a stored batch's jobs chunk by chunk in batch-index order, each chunk stamped
        published just before it goes (a thread stamps the next chunk, in the database, while this
        one is published); on failure mark the rest unpublished and raise PublishError."""

        def stamp(first_index: int) -> list[uuid.UUID]:
            with self.session_factory.begin() as session:
                return outbox.stamp_published(session, batch_id, first_index, chunk_size, utcnow())

        num_published = 0
        try:
            with contextlib.ExitStack() as stack:
                publisher = stack.enter_context(JobPublisher(celery_app, queue, PUBLISH_RETRY_POLICY,
                                                             message_priority, jobs_per_message))
                # one chunk (a single job): no stamping thread to start
                stamper = (stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="weir-stamp"))
                           if num_jobs > chunk_size else None)
                job_ids = stamp(0)
                while job_ids:
                    done = num_published + len(job_ids)
                    next_ids = stamper.submit(stamp, done) if stamper is not None and done < num_jobs else None
                    publisher.publish(job_ids)
                    num_published = done
                    if next_ids is None:
                        break
                    job_ids = next_ids.result()
        except Exception as exc:
            try:
                for first_index in range(num_published, num_jobs, chunk_size):
                    with self.session_factory.begin() as session:
                        outbox.stamp_published(session, batch_id, first_index, chunk_size, None)
            except Exception:  # the sweeper still finds them, once the queue has moved past them
                logger.exception("batch %s: cannot mark %d jobs unpublished", batch_id, num_jobs - num_published)
            raise PublishError(batch_id, num_jobs - num_published, exc) from exc

    def _publish_or_mark(
        self, celery_app: Any, job_ids: list[uuid.UUID], batch_id: Optional[uuid.UUID],
        queue: Optional[str] = None,
    ) -> None:
        """Publish one message per job to ``queue`` (default: the model's), in this order,
        ``DEFAULT_CHUNK_SIZE`` per round trip; on failure mark the jobs not yet published
        unpublished and raise PublishError."""
        num_published = 0
        try:
            with JobPublisher(celery_app, queue or self.queue, PUBLISH_RETRY_POLICY) as publisher:
                for start in range(0, len(job_ids), DEFAULT_CHUNK_SIZE):
                    chunk = job_ids[start:start + DEFAULT_CHUNK_SIZE]
                    publisher.publish(chunk)
                    num_published += len(chunk)
        except Exception as exc:
            unpublished = job_ids[num_published:]
            try:
                with self.session_factory.begin() as session:
                    outbox.mark_published(session, unpublished, None)
            except Exception:  # the sweeper still finds them, one deadline later
                logger.exception("batch %s: cannot mark %d jobs unpublished", batch_id, len(unpublished))
            raise PublishError(batch_id, len(unpublished), exc) from exc

    def sweep(self, older_than_s: Optional[float] = None, *, limit: int = 10_000) -> int:
        """Publish again the jobs of this client's model whose message is missing (see
        :mod:`weir.jobs.sweeper`: never-published jobs, expired leases, and queued jobs the queue has
        moved past, whatever the backlog; a waiting backlog is never re-published). Batches left
        ``validating`` for ``STALE_VALIDATING_S`` by a producer that died are deleted. Then the
        applications' periodic rules run (:data:`weir.jobs.applications.SWEEP_RULES`).

        Args:
            older_than_s: the grace in seconds; default ``WEIR_SWEEP_AFTER_S`` (60 s).
            limit: the most jobs published by one call.

        Returns:
            The number of jobs published.

        Raises:
            BrokerNotConfigured: no broker URL.
            PublishError: the broker refused the messages (the jobs are marked unpublished).
        """
        from weir.jobs.sweeper import take_lost_jobs

        grace_s = self.settings.worker.sweep_deadline_s if older_than_s is None else older_than_s
        celery_app = self.celery_app
        with celery_app.connection_for_read() as connection:
            redis = connection if connection.transport.driver_type == "redis" else None
            with self.session_factory.begin() as session:
                job_ids = take_lost_jobs(session, redis, model=self.model, queue=self.queue,
                                         grace_s=grace_s, limit=limit)
        with self.session_factory.begin() as session:
            stale = batches.delete_stale_validating(
                session, created_before=utcnow() - timedelta(seconds=STALE_VALIDATING_S))
        if stale:
            logger.warning("sweep: deleted %d batches left validating by a producer that died", len(stale))
        if job_ids:
            # To the control queue, which every worker of the model also consumes: a recovered
            # job runs at once instead of waiting behind the backlog it was lost from.
            self._publish_or_mark(celery_app, job_ids, batch_id=None, queue=names.control_queue(self.queue))
            logger.warning("sweep: published %d jobs again (no message for %gs)", len(job_ids), grace_s)
        self._run_sweep_rules()
        return len(job_ids)

    def _run_sweep_rules(self) -> None:
        """Run the applications' periodic rules (:data:`weir.jobs.applications.SWEEP_RULES`), each
        in a transaction of its own; a rule that raises is logged and the others still run."""
        from weir.jobs import applications

        for name, rule in applications.load_each(applications.SWEEP_RULES).items():
            def apply(rule=rule) -> int:
                with self.session_factory.begin() as session:
                    return rule(session, model=self.model, now=utcnow())

            try:
                num_changed = retry_on_conflict(apply)
            except Exception:
                logger.exception("sweep: rule %s failed", name)
                continue
            if num_changed:
                logger.warning("sweep: rule %s changed %d", name, num_changed)

    def reconcile(self) -> list:
        """Recount every unfinished batch from its jobs and repair what differs (see
        :func:`weir.jobs.counters.reconcile_batches`); returns the repaired batches."""
        with self.session_factory.begin() as session:
            return counters.reconcile_batches(session)

    def num_waiting_messages(self) -> int:
        """Messages waiting in the model's queues (:func:`weir.jobs.names.job_queues`: bulk,
        interactive and control; not counting those workers hold unacked).

        Raises:
            BrokerNotConfigured: no broker URL.
        """
        return sum(num_waiting_messages(self.celery_app, queue) for queue in names.job_queues(self.queue))

    def queue_consumers(self, timeout_s: float = 1.0) -> list[str]:
        """The workers that consume the model's queue, as Celery's remote control
        (``inspect().active_queues()``) finds them within ``timeout_s``: their node names, sorted;
        empty when none answers.

        Raises:
            BrokerNotConfigured: no broker URL.
        """
        replies = self.celery_app.control.inspect(timeout=timeout_s).active_queues() or {}
        return sorted(node for node, queues in replies.items()
                      if any(queue.get("name") == self.queue for queue in queues or ()))

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
            return BatchProgress.of(batches.get_batch(session, _as_uuid(batch_id)))

    def recent_batches(self, limit: int = 20) -> list[BatchProgress]:
        """The ``limit`` most recently created batches, newest first."""
        with self.session_factory() as session:
            return [BatchProgress.of(batch) for batch in batches.recent_batches(session, limit)]

    def wait(
        self,
        batch_id: BatchId,
        timeout_s: Optional[float] = None,
        *,
        progress: Any = None,
        poll_interval_s: float = 0.5,
        idle_s: Optional[float] = None,
        on_idle: Optional[Callable[[BatchProgress], None]] = None,
    ) -> BatchProgress:
        """Poll until the batch is finished (completed, failed or cancelled). On Postgres, a status
        change of the batch (the ``weir_batch`` channel, :class:`weir.jobs.batches.BatchChannel`)
        ends a wait between polls at once, so the call returns as the batch finishes rather than at
        the next poll; the polls keep ``progress`` current and stand in where no notification comes.

        Args:
            timeout_s: give up after this many seconds; None waits forever.
            progress: a tqdm bar (or anything with ``total``, ``n``, ``refresh()``) kept at the
                number of finished jobs.
            idle_s, on_idle: call ``on_idle(snapshot)`` once when no job of the batch has started
                ``idle_s`` seconds into the wait (no worker took any), and keep waiting.

        Returns:
            The final snapshot.

        Raises:
            TimeoutError: the batch is still running after ``timeout_s``.
            LookupError: no such batch.
        """
        with self.batch_channel.subscribe(_as_uuid(batch_id)) as changes:
            return self._wait(batch_id, changes, timeout_s, progress, poll_interval_s, idle_s, on_idle)

    def _wait(self, batch_id: BatchId, changes: batches.BatchSubscription, timeout_s: Optional[float], progress: Any,
              poll_interval_s: float, idle_s: Optional[float],
              on_idle: Optional[Callable[[BatchProgress], None]]) -> BatchProgress:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        idle_at = None if idle_s is None or on_idle is None else time.monotonic() + idle_s
        while True:
            snapshot = self.batch_status(batch_id)
            if progress is not None:
                progress.total = snapshot.num_jobs
                progress.n = snapshot.num_finished
                progress.refresh()
            if snapshot.status.is_finished:
                return snapshot
            if idle_at is not None and time.monotonic() >= idle_at:
                idle_at = None
                if snapshot.started_at is None:
                    on_idle(snapshot)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"batch {batch_id} still {snapshot.status.value} after {timeout_s}s: "
                    f"{snapshot.num_finished}/{snapshot.num_jobs} jobs finished"
                )
            changes.wait(poll_interval_s if deadline is None else min(poll_interval_s, deadline - time.monotonic()))

    def jobs(self, batch_id: BatchId) -> list[Job]:
        """The batch's job rows in submission order (detached, readable after the call); for a
        large batch use :meth:`iter_jobs`."""
        with self.session_factory() as session:
            return batches.list_jobs(session, _as_uuid(batch_id))

    def iter_jobs(self, batch_id: BatchId, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[Job]:
        """The batch's job rows in submission order (batch index), streamed page by page.

        A generator: each page of ``page_size`` rows is one short read of the ``(batch_id,
        batch_index)`` index in its own session, so memory stays bounded and no transaction stays
        open while the caller works between rows (a server-side cursor would, and Postgres ends a
        transaction idle longer than the engine's ``idle_in_transaction_session_timeout``). Rows
        are detached. Each page shows the database as it is when read: jobs finishing meanwhile
        show their new state in later pages. An unknown batch yields nothing.
        """
        batch_uuid = _as_uuid(batch_id)
        first_index = 0
        while True:
            with self.session_factory() as session:
                page = batches.jobs_page(session, batch_uuid, first_index=first_index, limit=page_size)
            yield from page
            if len(page) < page_size:
                return
            first_index = page[-1].batch_index + 1

    def results(self, batch_id: BatchId, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[dict[str, Any]]:
        """One dict per job, in submission order, streamed as :meth:`iter_jobs` streams the rows
        (a generator: ``list(client.results(b))`` to index or count them).

        Keys: ``job_id``, ``custom_id``, ``kind``, ``status``, ``attempts``, ``output_text``,
        ``label``, ``label_probs``, ``finish_reason``, ``completions``, ``parsed``,
        ``prompt_logprobs``, ``num_prompt_tokens``, ``num_completion_tokens``,
        ``num_cached_tokens``, ``error``, ``metadata`` (the request's), ``extensions`` (the
        request's application data by name, e.g. the catalog's ``enrichment``), ``sampling_params`` (a
        generation's sampling fields as stored, engine names, with its ``response_format`` if
        any; None for a classification), ``annotations`` (what each application registered under
        ``weir.result_annotations`` says about the row, by its name, e.g. the catalog's
        ``enrichment`` decision; ``{}`` when none does). The columns are described in
        :class:`weir.jobs.db.Job`.

        Raises:
            LookupError: no batch has this id (on the first item asked for).
        """
        self.batch_status(batch_id)  # an unknown batch is an error, not an empty result
        annotators = applications.load_each(applications.RESULT_ANNOTATIONS)
        for job in self.iter_jobs(batch_id, page_size=page_size):
            row = {
                "job_id": str(job.id),
                "custom_id": job.custom_id,
                "kind": job.kind.value,
                "status": job.status.value,
                "attempts": job.attempts,
                "output_text": job.output_text,
                "label": job.label,
                "label_probs": job.label_probs,
                "finish_reason": job.finish_reason,
                "completions": job.completions,
                "parsed": job.parsed,
                "prompt_logprobs": job.prompt_logprobs,
                "num_prompt_tokens": job.num_prompt_tokens,
                "num_completion_tokens": job.num_completion_tokens,
                "num_cached_tokens": job.num_cached_tokens,
                "error": job.error,
                "metadata": job.request.get("metadata", {}),
                "extensions": job.request.get("extensions", {}),
                "sampling_params": _sampling_params(job.request) if job.kind.value == "generate" else None,
            }
            annotations = {name: annotate(row) for name, annotate in annotators.items()}
            row["annotations"] = {name: value for name, value in annotations.items() if value is not None}
            yield row

    def cancel(self, batch_id: BatchId) -> BatchProgress:
        """Cancel the batch's queued and running jobs (see :func:`weir.jobs.batches.cancel_batch`).

        Raises:
            LookupError: no such batch.
        """
        def cancel():
            with self.session_factory.begin() as session:
                return BatchProgress.of(batches.cancel_batch(session, _as_uuid(batch_id)))

        return retry_on_conflict(cancel)

    def cancel_job(self, job_id: BatchId) -> Job:
        """Cancel one queued or running job (see :func:`weir.jobs.batches.cancel_job`).

        Raises:
            LookupError: no such job.
        """
        def cancel():
            with self.session_factory.begin() as session:
                return batches.cancel_job(session, _as_uuid(job_id))

        return retry_on_conflict(cancel)

    def close(self) -> None:
        """Stop the in-process worker, if this client started one (its running jobs finish
        first), and release database connections."""
        if self._embedded is not None:
            embedded, self._embedded = self._embedded, None
            embedded.close()
        self.batch_channel.close()
        self.engine.dispose()
