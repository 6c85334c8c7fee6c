"""An in-process Celery worker (threads pool, in a daemon thread) for the embedded mode.

``weir enrich`` without ``WEIR_BROKER_URL`` runs the very same tasks this way: the app's broker is
kombu's ``memory://`` transport, whose queues are shared by every connection in the process, so
the client publishes and this worker consumes without any server.
"""

from __future__ import annotations

import logging
import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from celery import Celery

from weir.config import Settings, get_settings
from weir.worker import runtime

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 120.0


@contextmanager
def embedded_worker(app: Celery, settings: Optional[Settings] = None) -> Iterator[runtime.WorkerRuntime]:
    """Run a worker for ``app`` consuming the model's queue in this process until the block exits.

    The engine is started first, in the calling thread (so a model that fails to load raises
    here); on exit the worker shuts down warm (running tasks finish) and the engine is drained.
    The worker is the one ``weir worker`` runs (:func:`weir.worker.app.make_worker`), without
    its signal handlers.

    Args:
        app: the Celery app whose tasks to run (``weir.worker.app.app``).
        settings: where the queue and concurrency come from; default :func:`weir.config.get_settings`.

    Yields:
        The process's :class:`weir.worker.runtime.WorkerRuntime` (its ``llm`` is loaded).

    Raises:
        TimeoutError: the worker did not become ready within ``READY_TIMEOUT_S``.
    """
    from celery.worker import state as worker_state

    import weir.worker.tasks  # noqa: F401  (registers the tasks on ``app``)
    from weir.worker.app import make_worker

    settings = settings or get_settings()
    worker_runtime = runtime.start_runtime(settings)
    ready = threading.Event()
    controller = make_worker(
        app,
        settings,
        hostname=f"embedded@{socket.gethostname()}",
        loglevel=logging.WARNING,
        embedded=True,
        ready_callback=lambda consumer: ready.set(),
    )
    thread = threading.Thread(target=controller.start, name="weir-embedded-worker", daemon=True)
    thread.start()
    try:
        if not ready.wait(READY_TIMEOUT_S):
            raise TimeoutError(f"embedded worker not ready after {READY_TIMEOUT_S}s")
        yield worker_runtime
    finally:
        # The consumer loop checks this flag between polls and then shuts down warm.
        worker_state.should_stop = 0
        thread.join(STOP_TIMEOUT_S)
        worker_state.should_stop = None
        if thread.is_alive():
            logger.warning("embedded worker still running after %ss", STOP_TIMEOUT_S)
        runtime.stop_runtime(drain=True)
