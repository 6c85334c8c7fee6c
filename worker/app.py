"""The Celery app of weir's workers, configured from :mod:`weir.config`.

Delivery is at-least-once: a message is acknowledged only after its task has stored the result
(``acks_late``), one message is reserved per thread (``worker_prefetch_multiplier=1``), and a
message whose worker dies is redelivered by kombu's Redis transport, which keeps every fetched
message in an unacked hash until its ack: ``WEIR_VISIBILITY_TIMEOUT_S`` after the fetch when the
worker died, at once when it shuts down warm (its channels put their unacked messages back).
Celery's ``task_reject_on_worker_lost`` is not used: it concerns a prefork child process that
dies, and a weir worker runs its tasks on threads of one process, which dies whole.
The worker reconnects to a lost broker forever. Warm shutdown gives running jobs
``WEIR_SHUTDOWN_TIMEOUT_S``, then aborts them and puts their messages back. Messages that are not
weir's (undecodable, not a task, an unknown task) are kept in ``dead_letters``. Tasks store their
own results in the database, so there is no result backend. Without ``WEIR_BROKER_URL`` the app
uses kombu's in-process ``memory://`` transport (the embedded mode of ``weir enrich``).

Celery's task events are on (``worker_send_task_events``), so Flower and ``celery events`` see
every task a worker takes; with ``WEIR_TASK_SEND_SENT_EVENT=true`` (Celery's
``task_send_sent_event``) every published job also sends its ``task-sent`` event, jobs published in
batches by ``weir.jobs.publisher`` included.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

from celery import Celery, bootsteps, signals
from celery.worker.consumer import Consumer
from kombu import Consumer as Consumer_

from weir.jobs import names
from weir.config import Settings, get_settings
from weir.worker import runtime
from weir.worker.beat import beat_schedule

logger = logging.getLogger(__name__)

EMBEDDED_BROKER_URL = "memory://localhost//"
MAX_RESTORE_INTERVAL_S = 10


def model_queue(settings: Settings) -> str:
    """The queue this deployment's workers consume: ``WEIR_QUEUE``, else ``weir.<model name>``."""
    return names.queue_for_model(settings.engine.model, settings.worker.queue)


def worker_concurrency(settings: Settings) -> int:
    """Prefetch window (and task threads) of the model's queue and control queue:
    ``WEIR_CONCURRENCY``, else ``WEIR_MAX_NUM_SEQS``."""
    return settings.worker.concurrency or settings.engine.max_num_seqs


def interactive_concurrency(settings: Settings) -> int:
    """Prefetch window (and task threads) of the model's interactive queue:
    ``WEIR_INTERACTIVE_CONCURRENCY``, else ``WEIR_MAX_NUM_SEQS``."""
    return settings.worker.interactive_concurrency or settings.engine.max_num_seqs


def bulk_concurrency(settings: Settings) -> int:
    """Prefetch window (and task threads) of the model's bulk queue: the chunks that fill the
    worker's engine, and one more (:func:`weir.worker.runtime.max_chunks`)."""
    return runtime.max_chunks(settings)


def pool_threads(settings: Settings) -> int:
    """Task threads of one worker's threads pool: one per message any prefetch window may hold
    (:func:`worker_concurrency` + :func:`interactive_concurrency` + :func:`bulk_concurrency`), so
    a message taken is never queued inside the pool behind another lane's."""
    return worker_concurrency(settings) + interactive_concurrency(settings) + bulk_concurrency(settings)


def transport_options(settings: Settings) -> dict:
    """kombu Redis transport options: the visibility timeout, a scan for expired unacked
    messages every ``min(10, visibility_timeout / 4)`` seconds (kombu's own default is ~100 s),
    and unacked-message keys of the model's queue's own (``<queue>.unacked``, ``.unacked_index``,
    ``.unacked_mutex``): kombu's default keys are shared by every consumer of the Redis
    database, so another deployment's shorter visibility timeout would restore this one's
    messages while they run."""
    visibility_timeout_s = settings.worker.visibility_timeout_s
    queue = model_queue(settings)
    return {
        "visibility_timeout": visibility_timeout_s,
        "unacked_restore_interval": max(1, min(MAX_RESTORE_INTERVAL_S, visibility_timeout_s // 4)),
        "unacked_restore_throttle": 1,
        "unacked_key": f"{queue}.unacked",
        "unacked_index_key": f"{queue}.unacked_index",
        "unacked_mutex_key": f"{queue}.unacked_mutex",
    }


def delivery_conf(settings: Settings) -> dict:
    """Celery settings of at-least-once delivery (see the module docstring): late acks, a lost
    worker's messages redelivered, one message reserved per thread, no result backend, JSON, the
    model's queue and the Redis transport options. ``bench.pipeline``'s baseline uses the same."""
    return dict(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=model_queue(settings),
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
    )


def make_app(settings: Settings) -> Celery:
    """Build the Celery app for ``settings`` (broker, queue, delivery guarantees, beat schedule)."""
    from weir.jobs import applications

    app = Celery("weir", broker=settings.worker.broker_url or EMBEDDED_BROKER_URL,
                 include=["weir.worker.tasks", *applications.task_modules()])
    app.conf.update(
        **delivery_conf(settings),
        broker_connection_max_retries=None,  # a worker outlives any broker restart
        worker_consumer="weir.worker.app:DeadLetterConsumer",
        worker_concurrency=pool_threads(settings),
        worker_send_task_events=True,  # Flower, `celery events`
        task_send_sent_event=settings.worker.task_send_sent_event,  # the nightly run's publishes
        beat_schedule=beat_schedule(settings),
        timezone="UTC",
    )
    if settings.worker.broker_url:  # an unreadable list entry is a dead letter, not the worker's end
        app.conf.broker_transport = "weir.worker.transport:Transport"
    app.steps["consumer"].update({InteractiveLane, BulkLane})
    return app


def make_worker(
    celery_app: Celery,
    settings: Settings,
    *,
    hostname: str,
    loglevel: Union[int, str],
    embedded: bool = False,
    ready_callback: Optional[Callable[[Any], None]] = None,
):
    """The Celery worker of ``weir worker`` and of the embedded mode, configured in one place.

    Both consume the model's queue and its control queue (:func:`model_queue`) in a prefetch
    window of :func:`worker_concurrency` messages, its interactive queue in one of
    :func:`interactive_concurrency` messages and its bulk queue in one of
    :func:`bulk_concurrency` messages, each on a channel of its own (:class:`InteractiveLane`,
    :class:`BulkLane`), with a thread of the threads pool for each message any window may hold
    (:func:`pool_threads`), without mingle or gossip
    (a worker needs nothing from its peers at start-up, and gossip costs every worker a message
    per event of every other).

    Args:
        celery_app: the app whose tasks to run (:data:`app`).
        settings: where the queue and concurrency come from.
        hostname: the worker's node name (stored on the jobs it claims).
        loglevel: Celery's log level.
        embedded: False: Celery's ``Worker``, run by :meth:`start` in the main thread, which
            installs the shutdown signal handlers (``weir worker``). True: a bare
            ``WorkController`` to run in a thread of this process (no signal handlers, no
            heartbeat; :mod:`weir.worker.embedded`).
        ready_callback: embedded only: called with the consumer once it consumes.

    Returns:
        The worker; ``start()`` runs it until shutdown.
    """
    queue = model_queue(settings)
    options = dict(
        hostname=hostname,
        pool="threads",
        concurrency=pool_threads(settings),
        queues=[queue, names.control_queue(queue)],
        loglevel=loglevel,
        without_mingle=True,
        without_gossip=True,
        weir_queue_concurrency=worker_concurrency(settings),
        weir_interactive_queue=names.interactive_queue(queue),
        weir_interactive_concurrency=interactive_concurrency(settings),
        weir_bulk_queue=names.bulk_queue(queue),
        weir_bulk_concurrency=bulk_concurrency(settings),
    )
    if not embedded:
        return celery_app.Worker(**options)
    from celery.worker import WorkController

    return WorkController(app=celery_app, without_heartbeat=True, ready_callback=ready_callback, **options)


class DeadLetterConsumer(Consumer):
    """Celery's consumer, keeping undecodable messages in ``dead_letters`` before it acks them.

    Its prefetch window (the model's queue and control queue) is :func:`worker_concurrency`
    messages: Celery would size it to the whole pool, whose other threads are the interactive
    lane's (:class:`InteractiveLane`)."""

    def __init__(self, *args, worker_options=None, **kwargs):
        threads = (worker_options or {}).get("weir_queue_concurrency")
        if threads:  # a worker of make_worker
            kwargs["initial_prefetch_count"] = threads * kwargs["prefetch_multiplier"]  # Celery's worker passes it
        super().__init__(*args, worker_options=worker_options, **kwargs)

    def on_decode_error(self, message, exc):
        _dead_letter(message, f"cannot decode the message body: {type(exc).__name__}: {exc}")
        super().on_decode_error(message, exc)


class _Lane(bootsteps.ConsumerStep):
    """Consumes one queue on a broker channel of its own, with a prefetch window of its own, into
    the same task handler as Celery's consumer: the messages are Celery task messages, run by the
    same pool (which has a thread for each), acked late the same way, and seen by events, Flower
    and ``celery inspect`` as any task.

    A Celery ``Consumer`` bootstep (``app.steps["consumer"]``), so it stops, closes its channel
    (kombu then puts its unacked messages back) and starts again with Celery's consumer on a
    broker reconnect or a warm shutdown. Subclasses name the worker options that give the queue
    and the window (:attr:`queue_option`, :attr:`concurrency_option`)."""

    queue_option = ""
    concurrency_option = ""

    def __init__(self, c, **kwargs):
        self.queue_name = kwargs.get(self.queue_option)
        self.prefetch = kwargs.get(self.concurrency_option)
        super().__init__(c, **kwargs)
        self.enabled = bool(self.queue_name)  # a worker of make_worker

    def start(self, c):
        self._consumer = c
        super().start(c)

    def get_consumers(self, channel):
        c = self._consumer
        handler = c.create_task_handler()
        return [Consumer_(channel, queues=[c.app.amqp.queues[self.queue_name]],
                          on_message=lambda message: handler(_acked_quietly_once_closed(message)),
                          on_decode_error=c.on_decode_error, accept=["json"],
                          prefetch_count=self.prefetch * c.prefetch_multiplier)]

    def _close(self, c, cancel_consumers=True):
        # Celery's version passes c.connection to kombu's ignore_errors, and after a lost broker
        # connection Celery has already set it to None: the channel would stay half closed.
        for consumer in self.consumers or []:
            if cancel_consumers:
                _quietly(consumer.cancel)
            if consumer.channel:
                _quietly(consumer.channel.close)
        self.consumers = None


class InteractiveLane(_Lane):
    """Consumes the model's interactive queue (:func:`weir.jobs.names.interactive_queue`:
    single jobs and priority-0 batches) in a window of :func:`interactive_concurrency` messages.
    However many bulk chunks the worker holds, an interactive message is taken within one broker
    poll and its job starts on a free thread at once; with ``WEIR_SCHEDULING_POLICY=priority`` the
    engine then steps it before bulk requests."""

    queue_option = "weir_interactive_queue"
    concurrency_option = "weir_interactive_concurrency"


class BulkLane(_Lane):
    """Consumes the model's bulk queue (:func:`weir.jobs.names.bulk_queue`: ``run_chunk``
    messages) in a window of :func:`bulk_concurrency` messages, the chunks the worker can run at
    once: each chunk taken starts at once, the rest of a batch waits in the broker for whichever
    worker frees first, and no chunk is fetched only to be put back."""

    queue_option = "weir_bulk_queue"
    concurrency_option = "weir_bulk_concurrency"


def _quietly(fun) -> None:
    try:
        fun()
    except Exception as exc:  # a channel of a lost connection: nothing left to release
        logger.debug("interactive lane: %s: %r", getattr(fun, "__qualname__", fun), exc)


def _acked_quietly_once_closed(message):
    """``message`` whose late ack or reject, after its channel went with a lost broker
    connection (kombu then raises AttributeError), is logged instead of ending the worker: the
    job's outcome is stored, and a message Redis still holds is redelivered to find it finished."""
    ack, reject = message.ack_log_error, message.reject_log_error
    message.ack_log_error = lambda log, errors, multiple=False: ack(log, (*errors, AttributeError), multiple)
    message.reject_log_error = lambda log, errors, requeue=False: reject(log, (*errors, AttributeError), requeue)
    return message


app = make_app(get_settings())


def _dead_letter(message, reason: str) -> None:
    from weir.worker.attempt import dead_letter

    headers = message.headers if isinstance(message.headers, dict) else {}
    try:
        dead_letter(
            runtime.get_runtime(),
            body=message.body,
            reason=reason,
            queue=(message.delivery_info or {}).get("routing_key"),
            task=headers.get("task"),
            message_id=headers.get("id"),
        )
    except Exception:  # the consumer must go on whatever the message was
        logger.exception("cannot keep a dead letter: %s", reason)


@signals.task_rejected.connect
def keep_rejected_message(sender=None, message=None, exc=None, **kwargs) -> None:
    """A message that is not a Celery task message, or an invalid one."""
    reason = "not a task message" if exc is None else f"invalid task message: {type(exc).__name__}: {exc}"
    _dead_letter(message, reason)


@signals.task_unknown.connect
def keep_unknown_task(sender=None, message=None, exc=None, name=None, **kwargs) -> None:
    """A task message for a task weir does not have."""
    _dead_letter(message, f"unknown task {name!r}")


@signals.worker_init.connect
def start_engine(sender=None, **kwargs) -> None:
    """Build the engine before the worker consumes anything; a worker that cannot load it exits."""
    if getattr(sender, "app", None) is not app:
        return
    settings = get_settings()
    for problem in settings.worker.delivery_problems():
        logger.warning("inconsistent delivery settings: %s", problem)
    from weir.worker.metrics import MetricsPortUnavailable

    try:
        runtime.start_runtime()
    except MetricsPortUnavailable as exc:  # taken since weir worker checked it: not the engine's fault
        raise SystemExit(f"weir worker: {exc}") from None
    except Exception as exc:
        logger.exception("cannot start the engine")
        # Celery logs and swallows exceptions from signal handlers; SystemExit gets through.
        raise SystemExit(f"weir worker: cannot start the engine: {type(exc).__name__}: {exc}") from exc


@signals.worker_shutting_down.connect
def start_grace_period(sig=None, how=None, **kwargs) -> None:
    """Warm shutdown: running jobs get ``WEIR_SHUTDOWN_TIMEOUT_S``, then go back to the queue."""
    worker_runtime = runtime.current_runtime()
    if worker_runtime is not None and how == "Warm":
        worker_runtime.begin_shutdown(worker_runtime.settings.worker.shutdown_timeout_s)


@signals.worker_shutdown.connect
def drain_engine(sender=None, **kwargs) -> None:
    """Finish what the engine holds, then close it (warm shutdown)."""
    if getattr(sender, "app", None) is not app:
        return
    runtime.stop_runtime(drain=True)
