"""kombu's Redis transport, with one change: a list entry that is not a message kombu can read
(not JSON, or a body its own encoding cannot decode, e.g. bad base64) is kept in ``dead_letters``
and skipped. kombu raises such an error out of the worker's event loop, which stops the worker
(Celery's "Unrecoverable error"); the entry was already popped, so it would be lost as well.

Used by the worker's app when it has a Redis broker (``broker_transport``); the text of such an
entry is gone once kombu has failed on it, so the dead letter holds the error and the queue, not
the entry.
"""

from __future__ import annotations

import logging

from kombu.transport import redis

logger = logging.getLogger(__name__)


class Channel(redis.Channel):
    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except ValueError as exc:  # json.JSONDecodeError, binascii.Error: the entry, not the broker
            # kombu moved the queue it read from to the end of its cycle before decoding
            items = getattr(self._queue_cycle, "items", None) or [None]
            _keep(items[-1], f"not a readable message: {type(exc).__name__}: {exc}")
            return True


class Transport(redis.Transport):
    Channel = Channel


def _keep(queue, reason: str) -> None:
    from weir.worker import runtime
    from weir.worker.attempt import dead_letter

    logger.warning("queue %s: %s (kept in dead_letters)", queue, reason)
    try:
        dead_letter(runtime.get_runtime(), body="", reason=reason, queue=queue, task=None, message_id=None)
    except Exception:  # the consumer must go on whatever the entry was
        logger.exception("cannot keep a dead letter: %s", reason)
