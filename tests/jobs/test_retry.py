"""The one retry loop: which errors it retries, how long it waits, when it gives up."""

import psycopg
import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError

from weir.jobs import retry as retry_module
from weir.jobs.retry import CONFLICT_ATTEMPTS, is_conflict, retry, retry_on_conflict


def conflict(sqlstate="40P01"):
    error = psycopg.errors.lookup(sqlstate)("deadlock detected")
    return DBAPIError.instance("UPDATE jobs", {}, error, psycopg.Error)


def failing(errors, answer="done"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return answer
    return fn, calls


def test_a_conflict_runs_the_transaction_again_with_growing_waits(monkeypatch):
    sleeps = []
    monkeypatch.setattr(retry_module.time, "sleep", sleeps.append)
    fn, calls = failing([conflict("40P01"), conflict("40001"), conflict("40P01")])
    assert retry_on_conflict(fn) == "done"
    assert len(calls) == 4
    assert sleeps == pytest.approx([0.05, 0.10, 0.15])


def test_conflicts_on_every_attempt_raise_the_last_one_unchanged(monkeypatch):
    sleeps = []
    monkeypatch.setattr(retry_module.time, "sleep", sleeps.append)
    errors = [conflict() for _ in range(CONFLICT_ATTEMPTS)]
    fn, calls = failing(errors)
    with pytest.raises(DBAPIError) as raised:
        retry_on_conflict(fn)
    assert raised.value is errors[-1]
    assert len(calls) == CONFLICT_ATTEMPTS == 5 and len(sleeps) == 4


def test_another_error_is_raised_at_once():
    duplicate = IntegrityError("INSERT", {}, Exception("duplicate key"))
    fn, calls = failing([duplicate])
    with pytest.raises(IntegrityError):
        retry_on_conflict(fn)
    assert len(calls) == 1
    assert not is_conflict(duplicate) and is_conflict(conflict("40001"))


def test_give_up_chooses_the_exception_and_ends_the_loop():
    waits = []

    def give_up(exc, num_tries, wait_s):
        waits.append((num_tries, wait_s))
        return TimeoutError(f"gave up after {num_tries}") if num_tries == 3 else None

    fn, calls = failing([ValueError("a")] * 5)
    with pytest.raises(TimeoutError, match="gave up after 3") as raised:
        retry(fn, retryable=lambda e: isinstance(e, ValueError), give_up=give_up, sleep=lambda s: None)
    assert isinstance(raised.value.__cause__, ValueError)
    assert waits == [(1, 1), (2, 2), (3, 4)]  # Celery's exponential backoff: 1, 2, 4 ... s
    assert len(calls) == 3
