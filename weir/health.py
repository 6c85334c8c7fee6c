"""Liveness checks for this host's worker and beat (``weir health worker|beat``, compose healthchecks).

Both checks ping over the broker's remote-control mailbox (Celery's ``celery.pidbox`` fanout
exchange), so they pass only when the process is up, connected to the broker, and its loop runs:

- A worker answers from its consumer, which starts only after ``worker_init`` has loaded the
  engine, so a worker still loading its model, or one whose engine failed, does not answer. It is
  asked which queues it consumes (``active_queues``), not only pinged: a worker of another model
  or queue on the same host does not pass for this one.
- Beat answers as ``celerybeat@<host>``, started with ``celery beat --enable-remote-control``
  (Celery >= 5.7) or embedded in ``weir worker --beat`` (which turns it on), and falls silent once its scheduler has not ticked for twice its max loop
  interval (at least 60 s): a beat stuck in its loop fails the check, not only a dead one.

The checks import neither the engine nor the task modules: a bare Celery app on the same broker
reaches the same mailbox. Exit statuses of ``weir health``: 0 when the process answered, 1 when it
did not (or the broker cannot be reached), 2 when ``WEIR_BROKER_URL`` is not set.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional

from celery import Celery
from kombu.utils.url import maybe_sanitize_url

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1

# `weir worker` names itself weir-<pid>@<nodename> (weir.cli.cmd_worker); the pid is not known here.
WORKER_NAME_PREFIX = "weir-"
# Celery's own name for beat's remote-control node (celery.beat.NODENAME_DEFAULT).
BEAT_NAME = "celerybeat"
PONG = {"ok": "pong"}


@dataclass(frozen=True)
class Health:
    """What a check found: ``healthy``, and one line saying who answered or why none did."""

    healthy: bool
    message: str

    @property
    def exit_status(self) -> int:
        """0 (:data:`EXIT_HEALTHY`) or 1 (:data:`EXIT_UNHEALTHY`)."""
        return EXIT_HEALTHY if self.healthy else EXIT_UNHEALTHY


def nodename() -> str:
    """This host's name, the part after ``@`` in the node names of its worker and beat."""
    return os.uname().nodename


def check_worker(broker_url: str, queue: str, hostname: Optional[str] = None,
                 timeout_s: float = 5.0) -> Health:
    """Ask this host's ``weir worker`` which queues it consumes (Celery's ``inspect().active_queues()``)
    and check that one consumes ``queue``.

    Workers on this host are asked one at a time, in the order they answer, each round excluding
    those already heard (a pcre pattern on the node name), so the check ends at the first worker
    consuming ``queue`` instead of waiting out ``timeout_s`` for every worker's answer.

    Args:
        broker_url: the broker the worker consumes from (``WEIR_BROKER_URL``).
        queue: the queue it must consume (``WEIR_QUEUE``, else ``weir.<model name>``).
        hostname: the worker's exact node name; by default any ``weir-<pid>@<this host>`` answers,
            since the pid is the worker's own (a container's worker is alone on its host name).
        timeout_s: how long to wait for the answers, all rounds together (and, at most, for the
            broker connection).

    Returns:
        Healthy when a matching worker that consumes ``queue`` answered within ``timeout_s`` (exit
        status 0); unhealthy when none answered, when those that answered consume other queues
        (the line names them), or when the broker cannot be reached (exit status 1).
    """
    where = maybe_sanitize_url(broker_url)  # password masked
    name = hostname or f"{WORKER_NAME_PREFIX}*@{nodename()}"
    app = _health_app(broker_url, timeout_s)
    heard: dict[str, list[str]] = {}  # node -> the queues it consumes (none of them ``queue``)
    deadline = time.monotonic() + timeout_s
    with app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
            while (remaining_s := deadline - time.monotonic()) > 0:
                if hostname:
                    target = {"destination": [hostname]}
                else:
                    target = {"pattern": _unheard_workers(heard), "matcher": "pcre", "limit": 1}
                replies = app.control.inspect(timeout=remaining_s, connection=connection,
                                              **target).active_queues()
                if not replies:
                    break
                for node, queues in replies.items():
                    consumed = _queue_names(queues)
                    if fnmatchcase(node, name) and queue in consumed:
                        return Health(True, f"{node} consumes {queue} on {where}")
                    heard[node] = consumed
                if hostname:
                    break
        except Exception as exc:  # any broker or transport error means "cannot tell": unhealthy
            return Health(False, f"cannot reach the broker at {where}: {_one_line(exc)}")
    if heard:
        found = "; ".join(f"{node} consumes {', '.join(queues) or 'nothing'}"
                          for node, queues in sorted(heard.items()))
        return Health(False, f"no worker of {name} on {where} consumes {queue} ({found})")
    return Health(False, f"no answer from {name} on {where} within {timeout_s:g}s")


def _queue_names(reply) -> list:
    """The queue names of one worker's ``active_queues`` reply (a list of queue declarations; an
    error reply, a dict, names none)."""
    if not isinstance(reply, list):
        return []
    return [declaration["name"] for declaration in reply if isinstance(declaration, dict) and "name" in declaration]


def _unheard_workers(heard: dict) -> str:
    """A pcre pattern (``re.match``) of this host's ``weir-*`` node names, less those in ``heard``."""
    host = re.escape(nodename())
    prefix = re.escape(WORKER_NAME_PREFIX)
    excluded = f"(?!(?:{'|'.join(re.escape(node) for node in heard)})$)" if heard else ""
    return f"^{excluded}{prefix}[^@]*@{host}$"


def check_beat(broker_url: str, hostname: Optional[str] = None, timeout_s: float = 5.0) -> Health:
    """Ping this host's beat: ``celery beat --enable-remote-control``, or the one embedded in
    ``weir worker --beat``.

    Args:
        broker_url: the broker beat publishes to (``WEIR_BROKER_URL``).
        hostname: beat's node name; default ``celerybeat@<this host>``, Celery's default.
        timeout_s: how long to wait for the answer (and, at most, for the broker connection).

    Returns:
        Healthy when beat answered ``pong`` within ``timeout_s``, which it does only while its
        scheduler ticks (exit status 0); unhealthy otherwise (exit status 1).
    """
    name = hostname or f"{BEAT_NAME}@{nodename()}"
    return _ping(broker_url, timeout_s, name=name)


def check_broker(broker_url: str, timeout_s: float = 5.0) -> Health:
    """Open and close one connection to the broker (``weir worker`` does, before it loads the
    engine: Celery itself would retry a wrong URL forever).

    Returns:
        Healthy when the broker accepted the connection within ``timeout_s``; else unhealthy,
        with one line naming the broker (password hidden) and why.
    """
    where = maybe_sanitize_url(broker_url)
    app = _health_app(broker_url, timeout_s)
    with app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
        except Exception as exc:  # whatever the transport raises, the broker cannot be used
            return Health(False, f"cannot reach the broker at {where}: {_one_line(exc)}")
    return Health(True, f"the broker at {where} answered")


def _ping(broker_url: str, timeout_s: float, name: str) -> Health:
    """Ping the node ``name``; healthy on its ``pong``."""
    where = maybe_sanitize_url(broker_url)  # password masked
    app = _health_app(broker_url, timeout_s)
    with app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
            replies = app.control.ping(destination=[name], timeout=timeout_s, connection=connection)
        except Exception as exc:  # any broker or transport error means "cannot tell": unhealthy
            return Health(False, f"cannot reach the broker at {where}: {_one_line(exc)}")
    for reply in replies:
        for node, answer in reply.items():
            if node == name and answer == PONG:
                return Health(True, f"{node} answered on {where}")
    return Health(False, f"no answer from {name} on {where} within {timeout_s:g}s")


def _health_app(broker_url: str, timeout_s: float) -> Celery:
    """A bare Celery app on ``broker_url``: one try at the broker, bounded by ``timeout_s`` (a
    healthcheck reports, it does not wait out an outage)."""
    app = Celery("weir-health", broker=broker_url, set_as_current=False)
    app.conf.update(broker_connection_timeout=timeout_s, broker_connection_retry=False)
    return app


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
