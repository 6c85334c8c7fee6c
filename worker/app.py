"""The Celery app of weir's workers, configured from :mod:`weir.config`.

Delivery is at-least-once: a message is acknowledged only after its task has stored the result
(``acks_late``), one message is reserved per thread (``worker_prefetch_multiplier=1``), and a
message whose worker dies is redelivered (``task_reject_on_worker_lost``; on Redis after
``WEIR_VISIBILITY_TIMEOUT_S``, or at once when the worker shuts down warm). Tasks store their own
results in the database, so there is no result backend. Without ``WEIR_BROKER_URL`` the app uses
kombu's in-process ``memory://`` transport (the embedded mode of ``weir enrich``).
"""

from __future__ import annotations

import logging

from celery import Celery, signals

from jobs import names
from weir.config import Settings, get_settings
from worker import runtime
from worker.beat import beat_schedule

logger = logging.getLogger(__name__)

EMBEDDED_BROKER_URL = "memory://localhost//"


def make_app(settings: Settings) -> Celery:
    """Build the Celery app for ``settings`` (broker, queue, delivery guarantees, beat schedule)."""
    queue = names.queue_for_model(settings.engine.model, settings.worker.queue)
    app = Celery("weir", broker=settings.worker.broker_url or EMBEDDED_BROKER_URL, include=["worker.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=queue,
        broker_transport_options={"visibility_timeout": settings.worker.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        worker_concurrency=settings.worker.concurrency or settings.engine.max_num_seqs,
        beat_schedule=beat_schedule(settings),
        timezone="UTC",
    )
    return app


app = make_app(get_settings())


@signals.worker_init.connect
def start_engine(sender=None, **kwargs) -> None:
    """Build the engine before the worker consumes anything; a worker that cannot load it exits."""
    if getattr(sender, "app", None) is not app:
        return
    try:
        runtime.start_runtime()
    except Exception as exc:
        logger.exception("cannot start the engine")
        # Celery logs and swallows exceptions from signal handlers; SystemExit gets through.
        raise SystemExit(f"weir worker: cannot start the engine: {type(exc).__name__}: {exc}") from exc


@signals.worker_shutdown.connect
def drain_engine(sender=None, **kwargs) -> None:
    """Finish what the engine holds, then close it (warm shutdown)."""
    if getattr(sender, "app", None) is not app:
        return
    runtime.stop_runtime(drain=True)
