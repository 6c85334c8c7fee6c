"""Publishing ``run_job`` messages: one per job, carrying only the job id, by task name, to a
model's queue.

Each message is the Celery task message (protocol 2, JSON) that ``Celery.send_task`` would make
(``app.amqp.as_task_v2``), sent as ``send_task`` sends it (``app.amqp.send_task_message``: the
``before_task_publish``/``after_task_publish`` signals, and a ``task-sent`` event when the app's
``task_send_sent_event`` is on, through the same producer) over one kombu connection. On Redis, one
:meth:`JobPublisher.publish` call goes out through kombu's publish batch (``Producer.batch``): its
messages' ``LPUSH`` commands are sent as one non-transactional pipeline, one round trip instead
of one per message, ``task-sent`` events included (``python -m bench.enqueue --jobs 200000``
on 2 cores: publish about 14,000 jobs/s without the events, 6,400 to 7,000/s with them; a
``send_task`` loop does about 2,000/s). Other transports (the embedded ``memory://``), and kombu before 5.7 (no publish batches),
publish each message at once.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Optional, Sequence

from celery.utils.nodenames import anon_nodename
from kombu.utils.functional import retry_over_time

try:
    from kombu.exceptions import BatchPublishError

    BATCH_ERRORS: tuple[type[BaseException], ...] = (BatchPublishError,)
except ImportError:  # kombu < 5.7: no publish batches
    BATCH_ERRORS = ()

from weir.jobs import names

PERSISTENT_DELIVERY_MODE = 2


class JobPublisher:
    """Publishes job messages to one queue through one broker connection, opened on ``__enter__``
    and released on ``__exit__``.

    A failed :meth:`publish` is retried under ``retry_policy`` (kombu's ``max_retries``,
    ``interval_start``, ``interval_step``, ``interval_max``) on a new connection. A Redis pipeline
    that fails part way may have delivered some of its messages, so a retry can publish a job
    twice; that is harmless (a job runs once under its lease and is stored once).

    Args:
        celery_app: the app whose broker, serializer, task-message format and
            ``task_send_sent_event`` are used.
        queue: the queue's name (declared, as ``send_task`` declares it, before the first message).
        retry_policy: as above; empty: no retry.
        priority: the messages' priority (kombu's, 0 to 9; on Redis, lower levels are polled
            first: 0, then 3, 6, 9, each level a list of its own).
        jobs_per_message: 1: one ``run_job`` message per job; more: one ``run_chunk`` message per
            this many jobs (a bulk batch's chunks, see ``weir.worker.chunk``).
    """

    def __init__(self, celery_app: Any, queue: str, retry_policy: Optional[dict[str, float]] = None,
                 priority: int = 0, jobs_per_message: int = 1) -> None:
        if jobs_per_message < 1:
            raise ValueError(f"jobs_per_message must be at least 1, got {jobs_per_message}")
        self._app = celery_app
        self._priority = priority
        self._jobs_per_message = jobs_per_message
        self._queue = celery_app.amqp.queues[queue]
        self._retry_policy = dict(retry_policy or {})
        self._connection: Any = None
        self._producer: Any = None
        self._declared = False
        self._origin = anon_nodename()  # what send_task stamps; computed once, not per message
        self._send_task_message = celery_app.amqp.send_task_message  # a new sender at each read
        self._send_sent_event = bool(celery_app.conf.task_send_sent_event)

    def __enter__(self) -> "JobPublisher":
        self._connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()

    def publish(self, job_ids: Sequence[uuid.UUID]) -> None:
        """Publish the jobs' messages (one per job, or one per ``jobs_per_message`` of them), in
        this order (workers take them in this order).

        Raises:
            kombu.exceptions.BatchPublishError, kombu.exceptions.OperationalError, or the
            transport's connection error: the broker failed after the retries; none, some or all
            of these messages may have arrived.
        """
        if not job_ids:
            return
        policy = self._retry_policy
        retry_over_time(
            self._publish_once, self._retriable_errors(), args=(job_ids,),
            errback=self._on_error, max_retries=policy.get("max_retries", 0),
            interval_start=policy.get("interval_start", 0), interval_step=policy.get("interval_step", 0.5),
            interval_max=policy.get("interval_max", 2.0),
        )

    def _publish_once(self, job_ids: Sequence[uuid.UUID]) -> None:
        producer, amqp = self._producer, self._app.amqp
        if not self._declared:
            producer.maybe_declare(self._queue)
            self._declared = True
        # One flush, on exit: the whole chunk in one pipeline.
        per = self._jobs_per_message
        task = names.RUN_JOB if per == 1 else names.RUN_CHUNK
        with producer.batch(max_size=len(job_ids) + 1) if self._can_batch else contextlib.nullcontext():
            for start in range(0, len(job_ids), per):
                args = [str(job_id) for job_id in job_ids[start:start + per]]
                message = amqp.as_task_v2(
                    str(uuid.uuid4()), task, args=args, kwargs={}, reply_to=self._app.thread_oid,
                    argsrepr=repr(args), kwargsrepr="{}", ignore_result=None, origin=self._origin,
                    create_sent_event=self._send_sent_event,
                )
                # declare=[]: declared once above; retry=False: publish() retries the whole chunk
                self._send_task_message(
                    producer, task, message, queue=self._queue, exchange="",
                    routing_key=self._queue.name, serializer="json", delivery_mode=PERSISTENT_DELIVERY_MODE,
                    declare=[], retry=False, priority=self._priority,
                )

    def _retriable_errors(self) -> tuple[type[BaseException], ...]:
        connection = self._connection
        return (*BATCH_ERRORS, *connection.connection_errors, *connection.channel_errors)

    def _on_error(self, exc: BaseException, intervals: Any, retries: int) -> float:
        self._release()
        self._connect()
        return next(intervals)

    def _connect(self) -> None:
        self._connection = self._app.connection_for_write()
        self._producer = self._app.amqp.Producer(self._connection)
        self._can_batch = hasattr(self._producer, "batch")
        self._declared = False

    def _release(self) -> None:
        if self._connection is not None:
            self._connection.release()
            self._connection = self._producer = None
