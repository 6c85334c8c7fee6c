"""Which database errors are worth another try, and the one loop that tries again.

Every place that runs a transaction again after a transient failure — the producer's cancel and
expiry (:func:`retry_on_conflict`), the worker's transactions outside the group committer
(``weir.worker.attempt.with_db_retry``) and the group committer itself — goes through
:func:`retry`, differing only in which errors it retries, how long it waits and when it gives up.
The waits are Celery's exponential backoff (``celery.utils.time.get_exponential_backoff_interval``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from celery.utils.time import get_exponential_backoff_interval
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_DB_BACKOFF_S = 10

# SQLSTATEs that mean "try again, maybe elsewhere": serialization failure, deadlock, lock not
# available, statement cancelled by timeout, read-only transaction (a failover in progress),
# admin/crash shutdown, cannot connect now, and every connection exception (class 08).
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014", "25006", "57P01", "57P02", "57P03"})

# deadlock detected, serialization failure: Postgres rolled the transaction back, nothing was written
CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})
CONFLICT_ATTEMPTS = 5
CONFLICT_BACKOFF_S = 0.05


def is_transient(exc: BaseException) -> bool:
    """Database errors worth retrying.

    True for a pool timeout (``sqlalchemy.exc.TimeoutError``: every connection busy), every
    ``OperationalError``/``InterfaceError`` (lost or refused connections, and under psycopg
    serialization failures, deadlocks, lock and statement timeouts), an error whose connection
    was invalidated, and any ``DBAPIError`` with a SQLSTATE in :data:`TRANSIENT_SQLSTATES` or of
    class ``08`` (such as ``25006`` read-only transaction, raised as ``InternalError`` while a
    failover makes the old primary a replica).
    """
    if isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        sqlstate = getattr(exc.orig, "sqlstate", None) or ""
        return sqlstate in TRANSIENT_SQLSTATES or sqlstate.startswith("08")
    return False


def is_conflict(exc: BaseException) -> bool:
    """A transaction Postgres aborted as a deadlock victim or a serialization failure
    (:data:`CONFLICT_SQLSTATES`): nothing of it was written, and running it again may succeed."""
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in CONFLICT_SQLSTATES


def exponential_backoff_s(num_tries: int) -> float:
    """Seconds to wait after ``num_tries`` failed tries (0, 1, ...): 1, 2, 4, 8, then
    :data:`MAX_DB_BACKOFF_S`."""
    return get_exponential_backoff_interval(1, num_tries, MAX_DB_BACKOFF_S)


def retry(fn: Callable[[], T], *, retryable: Callable[[BaseException], bool],
          give_up: Callable[[BaseException, int, float], BaseException | None],
          delay_s: Callable[[int], float] = exponential_backoff_s,
          sleep: Callable[[float], None] | None = None) -> T:
    """Call ``fn`` (one whole transaction) until it returns, waiting between tries.

    Args:
        fn: the transaction; called again only after an error ``retryable`` accepts.
        retryable: whether an error is worth another try; any other error propagates unchanged.
        give_up: called before each wait with the error, the number of failed tries so far (1, 2,
            ...) and the wait in seconds; returns None to wait and try again, or the exception to
            raise instead (the error itself to re-raise it unchanged).
        delay_s: the wait after ``n`` failed tries (``n`` from 0); Celery's exponential backoff by
            default.
        sleep: how to wait; ``time.sleep`` by default.

    Returns:
        What ``fn`` returned.
    """
    num_tries = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not retryable(exc):
                raise
            wait_s = delay_s(num_tries)
            num_tries += 1
            stop = give_up(exc, num_tries, wait_s)
            if stop is exc:
                raise
            if stop is not None:
                raise stop from exc
            (sleep or time.sleep)(wait_s)


def retry_on_conflict(fn: Callable[[], T]) -> T:
    """Run ``fn()`` (one whole transaction) again when Postgres aborts it as a deadlock victim or a
    serialization failure (:func:`is_conflict`): a cancel that updates thousands of job rows can
    meet a worker's group commit holding some of them. Waits 0.05, 0.1, 0.15 ... s.

    Raises:
        sqlalchemy.exc.DBAPIError: any other database error, or a conflict on every one of
            ``CONFLICT_ATTEMPTS`` attempts.
    """
    def give_up(exc: BaseException, num_tries: int, wait_s: float) -> BaseException | None:
        if num_tries >= CONFLICT_ATTEMPTS:
            return exc
        logger.info("transaction aborted by a conflict (%s), attempt %d; running it again",
                    exc.orig.sqlstate, num_tries)
        return None

    return retry(fn, retryable=is_conflict, give_up=give_up,
                 delay_s=lambda n: CONFLICT_BACKOFF_S * (n + 1))


def first_line(exc: BaseException) -> str:
    """The first line of the exception's message (a database error's is its driver's summary, its
    SQL and parameters following on other lines), or its type's name when it has none."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
