"""Liveness checks for this host's worker and beat (``weir health worker|beat``, compose healthchecks).

Both checks ping over the broker's remote-control mailbox (Celery's ``celery.pidbox`` fanout
exchange), so they pass only when the process is up, connected to the broker, and its loop runs:

- A worker answers from its consumer, which starts only after ``worker_init`` has loaded the
  engine, so a worker still loading its model, or one whose engine failed, does not answer.
- Beat answers as ``celerybeat@<host>`` when started with ``celery beat --enable-remote-control``
  (Celery >= 5.7), and falls silent once its scheduler has not ticked for twice its max loop
  interval (at least 60 s): a beat stuck in its loop fails the check, not only a dead one. An
  embedded beat (``weir worker --beat``) does not answer; the worker's check covers that process.

The checks import neither the engine nor the task modules: a bare Celery app on the same broker
reaches the same mailbox. Exit statuses of ``weir health``: 0 when the process answered, 1 when it
did not (or the broker cannot be reached), 2 when ``WEIR_BROKER_URL`` is not set.
"""

from __future__ import annotations

import os
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


def check_worker(broker_url: str, hostname: Optional[str] = None, timeout_s: float = 5.0) -> Health:
    """Ping this host's ``weir worker``.

    Args:
        broker_url: the broker the worker consumes from (``WEIR_BROKER_URL``).
        hostname: the worker's exact node name; by default any ``weir-<pid>@<this host>`` answers,
            since the pid is the worker's own (a container's worker is alone on its host name).
        timeout_s: how long to wait for the answer (and, at most, for the broker connection).

    Returns:
        Healthy when a matching worker answered ``pong`` within ``timeout_s`` (exit status 0);
        unhealthy when none did or the broker cannot be reached (exit status 1).
    """
    if hostname:
        return _ping(broker_url, timeout_s, name=hostname, destination=[hostname])
    name = f"{WORKER_NAME_PREFIX}*@{nodename()}"
    return _ping(broker_url, timeout_s, name=name, pattern=name)


def check_beat(broker_url: str, hostname: Optional[str] = None, timeout_s: float = 5.0) -> Health:
    """Ping this host's ``celery beat`` (started with ``--enable-remote-control``).

    Args:
        broker_url: the broker beat publishes to (``WEIR_BROKER_URL``).
        hostname: beat's node name; default ``celerybeat@<this host>``, Celery's default.
        timeout_s: how long to wait for the answer (and, at most, for the broker connection).

    Returns:
        Healthy when beat answered ``pong`` within ``timeout_s``, which it does only while its
        scheduler ticks (exit status 0); unhealthy otherwise (exit status 1).
    """
    name = hostname or f"{BEAT_NAME}@{nodename()}"
    return _ping(broker_url, timeout_s, name=name, destination=[name])


def check_broker(broker_url: str, timeout_s: float = 5.0) -> Health:
    """Open and close one connection to the broker (``weir worker`` does, before it loads the
    engine: Celery itself would retry a wrong URL forever).

    Returns:
        Healthy when the broker accepted the connection within ``timeout_s``; else unhealthy,
        with one line naming the broker (password hidden) and why.
    """
    where = maybe_sanitize_url(broker_url)
    app = Celery("weir-health", broker=broker_url, set_as_current=False)
    app.conf.update(broker_connection_timeout=timeout_s, broker_connection_retry=False)
    with app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
        except Exception as exc:  # whatever the transport raises, the broker cannot be used
            return Health(False, f"cannot reach the broker at {where}: {_one_line(exc)}")
    return Health(True, f"the broker at {where} answered")


def _ping(broker_url: str, timeout_s: float, name: str, destination: Optional[list] = None,
          pattern: Optional[str] = None) -> Health:
    """Ping the nodes named in ``destination``, or those matching the glob ``pattern``; healthy on
    the first ``pong`` from a node that ``name`` (a name or a glob) covers."""
    where = maybe_sanitize_url(broker_url)  # password masked
    app = Celery("weir-health", broker=broker_url, set_as_current=False)
    # One try at the broker, bounded by timeout_s: a healthcheck reports, it does not wait out an outage.
    app.conf.update(broker_connection_timeout=timeout_s, broker_connection_retry=False)
    with app.connection_for_write() as connection:
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
            matching = {"pattern": pattern, "matcher": "glob", "limit": 1} if pattern else {}
            replies = app.control.ping(destination=destination, timeout=timeout_s,
                                       connection=connection, **matching)
        except Exception as exc:  # any broker or transport error means "cannot tell": unhealthy
            return Health(False, f"cannot reach the broker at {where}: {_one_line(exc)}")
    for reply in replies:
        for node, answer in reply.items():
            if fnmatchcase(node, name) and answer == PONG:
                return Health(True, f"{node} answered on {where}")
    return Health(False, f"no answer from {name} on {where} within {timeout_s:g}s")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
