"""The sweeper: publish again the jobs whose message is missing, whatever the backlog.

A job's message can go missing three ways: its publish failed (the client then leaves
``published_at`` null), Redis lost it (a restart without persistence, a key deleted by hand), or
a worker took it and died before kombu recorded it as unacked. The sweeper finds each kind
without re-publishing a backlog that is merely waiting:

- a job never published is published at once;
- a ``running`` job whose lease expired more than ``WEIR_SWEEP_AFTER_S`` ago (its worker died or
  lost the database) and that was not published since is published again;
- a ``queued`` job is lost when the queue has moved past it. Redis queues are FIFO lists (kombu
  pushes on the left and workers pop on the right), so every message published before the
  oldest one still waiting has been taken from the queue. A queued job last published more than
  ``WEIR_SWEEP_AFTER_S`` before that oldest waiting message (or, with an empty queue, more than
  ``WEIR_SWEEP_AFTER_S`` ago) has no message left. The grace covers messages a worker has taken
  but not yet claimed.

Bound: a lost message is published again within ``WEIR_SWEEP_INTERVAL_S + WEIR_SWEEP_AFTER_S`` of
the moment the queue reached it (when it would have run), however long the backlog behind it.
A job published twice still runs once (its lease) and is stored once.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from datetime import datetime, timedelta
from typing import Any, Optional

from jobs import store
from jobs.db import utcnow

logger = logging.getLogger(__name__)


def oldest_waiting_job(connection: Any, queue: str) -> Optional[uuid.UUID]:
    """The job id of the oldest message waiting in ``queue`` on a Redis broker, or None when the
    queue is empty or its oldest message is not a ``run_job`` message.

    Args:
        connection: a kombu connection to the broker.
        queue: the queue's name (kombu's Redis list of that name; priority sub-lists ignored).
    """
    client = connection.default_channel.client
    raw = client.lindex(queue, -1)
    if raw is None:
        return None
    try:
        envelope = json.loads(raw)
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return uuid.UUID(str(args[0]))
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def queued_horizon(session: Any, connection: Any, queue: str, grace_s: float) -> Optional[datetime]:
    """The publish time before which a ``queued`` job has no message left (see the module
    docstring): ``now - grace`` for an empty queue, the oldest waiting message's publish time
    less ``grace`` otherwise, None when that time cannot be known (no such job: take none)."""
    if connection.default_channel.client.llen(queue) == 0:
        return utcnow() - timedelta(seconds=grace_s)
    job_id = oldest_waiting_job(connection, queue)
    if job_id is None:
        return None
    published = store.published_at(session, job_id)
    return None if published is None else published - timedelta(seconds=grace_s)


def take_lost_jobs(session: Any, connection: Any, *, model: str, queue: str, grace_s: float,
                   limit: int) -> list[uuid.UUID]:
    """The jobs whose message is missing, stamped published now (not committed; see
    :func:`jobs.store.take_jobs_to_publish`). ``connection`` is None on a broker that is not
    Redis: then only never-published jobs and expired leases are taken."""
    horizon = None
    if connection is not None:
        horizon = queued_horizon(session, connection, queue, grace_s)
    return store.take_jobs_to_publish(
        session, model=model, older_than=utcnow() - timedelta(seconds=grace_s), limit=limit,
        queued_before=horizon,
    )
