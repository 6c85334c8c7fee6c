from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError

from worker.tasks import _is_transient


def test_transient_database_errors_are_retried():
    assert _is_transient(OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    assert _is_transient(InterfaceError("SELECT 1", {}, Exception("connection already closed")))
    assert _is_transient(DBAPIError("SELECT 1", {}, Exception("lost"), connection_invalidated=True))


def test_other_errors_are_not_retried():
    assert not _is_transient(IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not _is_transient(ProgrammingError("SELECT", {}, Exception('relation "jobs" does not exist')))
    assert not _is_transient(ValueError("bad job id"))
