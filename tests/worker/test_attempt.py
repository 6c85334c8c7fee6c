"""Pieces of one delivery that need no worker: which database errors are transient, and how a
``run_job`` message's arguments are read."""

import uuid

import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError

from worker.attempt import MalformedMessage, is_transient, parse_job_id


def test_transient_database_errors_are_retried():
    assert is_transient(OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    assert is_transient(InterfaceError("SELECT 1", {}, Exception("connection already closed")))
    assert is_transient(DBAPIError("SELECT 1", {}, Exception("lost"), connection_invalidated=True))


def test_serialization_failure_and_refused_connection_are_transient():
    import psycopg

    serialization = psycopg.errors.SerializationFailure("could not serialize access")
    refused = psycopg.OperationalError("connection refused")
    from sqlalchemy.exc import DBAPIError as Wrap

    assert is_transient(Wrap.instance("UPDATE jobs", {}, serialization, psycopg.Error))
    assert is_transient(Wrap.instance("SELECT 1", {}, refused, psycopg.Error))


def test_other_errors_are_not_retried():
    assert not is_transient(IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not is_transient(ProgrammingError("SELECT", {}, Exception('relation "jobs" does not exist')))
    assert not is_transient(ValueError("bad job id"))


def test_job_id_is_the_only_argument():
    job_id = uuid.uuid4()
    assert parse_job_id((str(job_id),), {}) == job_id


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((), {}, "run_job takes args [job_id], got args [] kwargs {}"),
        (("a", "b"), {}, "run_job takes args [job_id], got args ['a', 'b'] kwargs {}"),
        ((), {"job_id": "x"}, "run_job takes args [job_id], got args [] kwargs {'job_id': 'x'}"),
        ((42,), {}, "job id must be a UUID string, got int 42"),
        (("not-a-uuid",), {}, "job id 'not-a-uuid' is not a UUID"),
    ],
)
def test_malformed_arguments_are_named(args, kwargs, message):
    with pytest.raises(MalformedMessage) as info:
        parse_job_id(args, kwargs)
    assert str(info.value) == message
