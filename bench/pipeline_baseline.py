"""The peer of ``bench/pipeline.py``: a bare Celery app whose one task upserts one row into Postgres.

Started by the benchmark as::

    python -m celery -A bench.pipeline_baseline worker -P threads -c 32 -Q <queue> --loglevel WARNING

It reads the same ``WEIR_*`` variables as ``weir worker`` (through :mod:`weir.config`):
``WEIR_BROKER_URL``, ``WEIR_QUEUE`` and ``WEIR_DATABASE_URL``. Its delivery settings are weir's
own (:func:`weir.worker.app.delivery_conf`: the Redis transport options, ``task_acks_late``,
``worker_prefetch_multiplier=1``, JSON messages, no result backend). Its database engine is built the same way (:func:`weir.jobs.db.make_engine`, default pool).

The task takes one id string, as ``weir.run_job`` does, and in one transaction upserts the row
``(id, output_text, finished_at)`` of :data:`TABLE` (created by the benchmark), stamping
``finished_at`` with the worker's clock, as weir stamps ``weir.jobs.finished_at``. That is the least a
queue-to-database pipeline does per message; weir's figure is judged against it.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Optional

from celery import Celery, signals
from sqlalchemy import Engine, text

from weir.jobs.db import make_engine
from weir.config import get_settings
from weir.worker.app import delivery_conf

logger = logging.getLogger(__name__)

STORE_RESULT = "bench.pipeline_baseline.store_result"
"""Upsert one row. Args: ``(row_id: str)``."""

TABLE = "pipeline_baseline_results"
CREATE_TABLE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} "
    "(id uuid PRIMARY KEY, output_text text NOT NULL, finished_at timestamptz NOT NULL)"
)
UPSERT = text(
    f"INSERT INTO {TABLE} (id, output_text, finished_at) VALUES (:id, :output_text, :finished_at) "
    "ON CONFLICT (id) DO UPDATE SET output_text = excluded.output_text, finished_at = excluded.finished_at"
)

settings = get_settings()
app = Celery("weir-pipeline-baseline", broker=settings.worker.broker_url)
app.conf.update(**delivery_conf(settings))  # exactly weir's delivery settings

_engine: Optional[Engine] = None
_engine_lock = threading.Lock()


def db_engine() -> Engine:
    """The process's one SQLAlchemy engine, built on first use (task threads share its pool)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = make_engine(settings.database.url())
        return _engine


@app.task(name=STORE_RESULT)
def store_result(row_id: str) -> None:
    """Upsert the row ``row_id`` in one transaction."""
    with db_engine().begin() as connection:
        connection.execute(UPSERT, {"id": row_id, "output_text": "x", "finished_at": datetime.now(timezone.utc)})


@signals.worker_ready.connect
def announce_ready(sender=None, **kwargs) -> None:
    # The benchmark waits for " ready." in the log, which Celery itself writes only at INFO.
    logger.warning("%s ready.", getattr(sender, "hostname", "pipeline-baseline"))
