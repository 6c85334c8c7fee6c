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
  oldest one still waiting has been taken from the queue. Each sweep records the publish time of
  the oldest waiting message (now, for an empty queue) with the time it saw it; a queued job last
  published before the oldest message a sweep saw at least ``WEIR_SWEEP_AFTER_S`` ago has had
  that long to be claimed since the queue moved past it, so its message is lost. The grace
  covers messages a worker has taken but not yet claimed. Each list of the model's queues
  (:func:`weir.jobs.names.job_queues`: bulk, interactive, and the control queue the sweeper
  publishes to; one list per priority level) bounds the horizon the same way, the earliest
  bound counting.

Applications add periodic rules of their own (:data:`weir.jobs.applications.SWEEP_RULES`: the
OpenAI batch application expires batches whose completion window has passed), which every sweep
runs after the lost jobs.

Recovered messages go to the model's control queue (``<queue>.control``), which every worker also
consumes, so they do not wait behind the backlog again. Bound: a lost message is published again
within ``WEIR_SWEEP_INTERVAL_S + WEIR_SWEEP_AFTER_S`` of the moment the queue reached it (when it
would have run), however long the backlog behind it, and runs right after. A job published twice
still runs once (its lease) and is stored once.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from datetime import datetime, timedelta
from typing import Any, Optional, Sequence

from weir.jobs import names, outbox
from weir.jobs.db import utcnow

logger = logging.getLogger(__name__)


OLDEST_SCAN = 10
"""How many of a queue's oldest messages are read to find its oldest ``run_job`` (control tasks
such as a sweep share the control queue)."""


def oldest_waiting_job(connection: Any, queue: str) -> Optional[uuid.UUID]:
    """The job id of the oldest ``run_job`` message waiting in ``queue`` on a Redis broker (the
    first job of a ``run_chunk`` message; among its ``OLDEST_SCAN`` oldest messages), or None
    when there is none.

    Args:
        connection: a kombu connection to the broker.
        queue: the name of one Redis list (a queue's list for one priority level, see
            :func:`priority_lists`).
    """
    client = connection.default_channel.client
    for raw in reversed(client.lrange(queue, -OLDEST_SCAN, -1)):  # oldest first
        try:
            envelope = json.loads(raw)
            if envelope.get("headers", {}).get("task") not in (names.RUN_JOB, names.RUN_CHUNK):
                continue
            body = envelope["body"]
            if envelope.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            return uuid.UUID(str(json.loads(body)[0][0]))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue
    return None


HISTORY_KEY = "weir.sweeper.{queue}"
HISTORY_KEEP_S = 3600


Horizon = tuple  # (published_at, batch id or None, batch index or None)


def queue_horizon(session: Any, connection: Any, queue: str, grace_s: float) -> Optional[Horizon]:
    """The position before which no message of ``queue`` has been waiting for ``grace_s``
    seconds: that of the queue's oldest waiting message as some sweep saw it at least ``grace_s``
    ago (each sweep records what it sees in ``weir.sweeper.<queue>`` on the broker). A position is
    the message's publish time and, since one publish sends a batch's messages in batch-index
    order under one time, its job's batch and index. The queue is FIFO, so a job published before
    that position and still ``queued`` has had ``grace_s`` seconds to be claimed since the queue
    moved past it: its message is lost. None when no record is old enough yet, or the oldest
    message cannot be placed."""
    client = connection.default_channel.client
    now = utcnow()
    head: Optional[list] = None
    if client.llen(queue) == 0:
        head = [now.isoformat(), None, None]  # everything published so far has left the queue
    else:
        job_id = oldest_waiting_job(connection, queue)
        row = None if job_id is None else outbox.publish_position(session, job_id)
        if row is not None:
            head = [row[0].isoformat(), str(row[1]), row[2]]
    key = HISTORY_KEY.format(queue=queue)
    if head is not None:
        client.zadd(key, {json.dumps(head): now.timestamp()})
    client.zremrangebyscore(key, "-inf", now.timestamp() - max(HISTORY_KEEP_S, 2 * grace_s))
    client.expire(key, int(max(HISTORY_KEEP_S, 2 * grace_s)))
    seen = [json.loads(m) for m in client.zrangebyscore(key, "-inf", now.timestamp() - grace_s)]
    if not seen:
        return None
    published, batch_id, index = max(seen, key=lambda h: (h[0], h[2] if h[2] is not None else -1))
    return (datetime.fromisoformat(published), None if batch_id is None else uuid.UUID(batch_id), index)


def priority_lists(connection: Any, queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages: one per kombu priority level (the queue's
    own name for level 0, ``<queue><sep><level>`` for the others). Each is FIFO by itself, so the
    horizon is found per list."""
    channel = connection.default_channel
    return [f"{queue}{channel.sep}{level}" if level else queue for level in channel.priority_steps]


def queued_horizon(session: Any, connection: Any, queues: Sequence[str], grace_s: float) -> Optional[Horizon]:
    """The position before which a ``queued`` job has no message left in any of ``queues``:
    the earliest of their :func:`queue_horizon` (None when any is unknown)."""
    horizons = [queue_horizon(session, connection, queue, grace_s) for queue in queues]
    if any(h is None for h in horizons):
        return None
    return min(horizons, key=lambda h: (h[0], h[2] if h[2] is not None else float("inf")))


def take_lost_jobs(session: Any, connection: Any, *, model: str, queue: str, grace_s: float,
                   limit: int) -> list[uuid.UUID]:
    """The jobs whose message is missing, stamped published now (not committed; see
    :func:`weir.jobs.outbox.take_jobs_to_publish`). ``connection`` is None on a broker that is not
    Redis: then only never-published jobs and expired leases are taken."""
    horizon = None
    if connection is not None:
        horizon = queued_horizon(session, connection, [
            level for q in names.job_queues(queue) for level in priority_lists(connection, q)], grace_s)
    return outbox.take_jobs_to_publish(
        session, model=model, older_than=utcnow() - timedelta(seconds=grace_s), limit=limit,
        queued_before=None if horizon is None else horizon[0],
        queued_before_job=None if horizon is None or horizon[1] is None else (horizon[1], horizon[2]),
    )

