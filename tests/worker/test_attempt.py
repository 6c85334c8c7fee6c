"""Pieces of one delivery that need no worker process: which database errors are transient, how
a ``run_job`` message's arguments are read, the retry loop, and what is stored when the database
refuses a result."""

import uuid
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError

from tests import support
from weir.config import WorkerSettings
from weir.jobs.batches import get_batch, list_jobs
from weir.jobs.claims import ClaimStatus
from weir.jobs.db import Job, JobStatus, make_engine, make_session_factory
from weir.jobs.results import JobResult
from weir.jobs.retry import is_transient
from weir.jobs.schemas import GenerateRequest
from weir.worker import attempt
from weir.worker.attempt import DatabaseUnavailable, MalformedMessage, parse_job_id, with_db_retry


def test_transient_database_errors_are_retried():
    assert is_transient(OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    assert is_transient(InterfaceError("SELECT 1", {}, Exception("connection already closed")))
    assert is_transient(DBAPIError("SELECT 1", {}, Exception("lost"), connection_invalidated=True))


def test_serialization_failure_and_refused_connection_are_transient():
    import psycopg

    serialization = psycopg.errors.SerializationFailure("could not serialize access")
    refused = psycopg.OperationalError("connection refused")

    assert is_transient(DBAPIError.instance("UPDATE jobs", {}, serialization, psycopg.Error))
    assert is_transient(DBAPIError.instance("SELECT 1", {}, refused, psycopg.Error))


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


# ---- retries and the storing of results, with a stand-in runtime over a real database ------------


def stand_in(session_factory=None, **worker_settings):
    return SimpleNamespace(settings=SimpleNamespace(worker=WorkerSettings(**worker_settings)),
                           session_factory=session_factory, model_name="tiny", is_stopping=False)


def lost_connection():
    return OperationalError("SELECT 1", {}, Exception("connection refused"))


def test_transient_errors_are_retried_until_the_call_succeeds(monkeypatch):
    sleeps = []
    monkeypatch.setattr(attempt.time, "sleep", sleeps.append)
    calls = iter([lost_connection(), lost_connection(), lost_connection(), "stored"])

    def call():
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert with_db_retry(stand_in(db_retry_timeout_s=60), "write", call) == "stored"
    assert sleeps == [1, 2, 4]


def test_transient_errors_past_the_retry_timeout_give_up():
    def call():
        raise lost_connection()

    with pytest.raises(DatabaseUnavailable, match="write: database unreachable for 0s: "):
        with_db_retry(stand_in(db_retry_timeout_s=0), "write", call)


def test_other_errors_are_raised_at_once():
    calls = []

    def call():
        calls.append(1)
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    with pytest.raises(IntegrityError):
        with_db_retry(stand_in(db_retry_timeout_s=60), "write", call)
    assert calls == [1]


def test_a_result_the_database_refuses_for_good_becomes_a_failure_not_a_running_job(postgres_url):
    engine = make_engine(postgres_url)
    session_factory = make_session_factory(engine)
    try:
        with session_factory.begin() as session:
            _, [job] = support.create_batch(session, [GenerateRequest(prompt="p")], model="tiny")
        with session_factory.begin() as session:
            job = support.claim_job(session, job.id)
        from weir.worker.group_commit import GroupCommitter

        writer = GroupCommitter(session_factory, worker="w", lease_s=60, max_attempts=3,
                                model_name=lambda: "tiny", retry_timeout_s=5)
        # finish_reason is VARCHAR(16): Postgres refuses this value, and would every time.
        stored_result = attempt._store(writer, job, JobResult(status=JobStatus.SUCCEEDED, output_text="x",
                                                              finish_reason="a-reason-far-too-long"))
        assert stored_result.status == JobStatus.FAILED  # what weir:jobs_total counts
        writer.close()
        with session_factory() as session:
            stored = list_jobs(session, job.batch_id)[0]
            batch = get_batch(session, job.batch_id)
        assert (stored.status, stored.output_text, stored.finish_reason) == (JobStatus.FAILED, None, None)
        assert stored.error == ("result not stored: DataError: (psycopg.errors.StringDataRightTruncation) "
                                "value too long for type character varying(16)")
        assert (batch.num_failed, batch.status.value) == (1, "failed")
    finally:
        engine.dispose()


def test_pool_timeout_read_only_failover_and_lock_timeout_are_transient():
    import psycopg
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    read_only = psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")
    lock_timeout = psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")
    deadlock = psycopg.errors.DeadlockDetected("deadlock detected")
    assert is_transient(PoolTimeout("QueuePool limit of size 5 overflow 5 reached"))
    assert is_transient(DBAPIError.instance("UPDATE jobs", {}, read_only, psycopg.Error))
    assert is_transient(DBAPIError.instance("UPDATE jobs", {}, lock_timeout, psycopg.Error))
    assert is_transient(DBAPIError.instance("UPDATE jobs", {}, deadlock, psycopg.Error))
    unique = psycopg.errors.UniqueViolation("duplicate key")
    assert not is_transient(DBAPIError.instance("INSERT", {}, unique, psycopg.Error))


def test_two_deliveries_of_one_job_in_one_claim_group_run_it_once(postgres_url):
    from weir.worker.group_commit import GroupCommitter

    engine = make_engine(postgres_url)
    session_factory = make_session_factory(engine)
    try:
        with session_factory.begin() as session:
            _, [job, other] = support.create_batch(session, [GenerateRequest(prompt="p"), GenerateRequest(prompt="q")],
                                                   model="tiny")
        # a long group wait: both claims of the job (and one of another) share one transaction
        writer = GroupCommitter(session_factory, worker="w", lease_s=60, max_attempts=3,
                                model_name=lambda: "tiny", retry_timeout_s=5, max_wait_s=0.5)
        futures = [writer.claim_async(job.id), writer.claim_async(other.id), writer.claim_async(job.id)]
        claims = [f.result(timeout=30) for f in futures]
        writer.close()
        assert writer.num_transactions == 1
        assert [c.status for c in claims] == [ClaimStatus.CLAIMED, ClaimStatus.CLAIMED,
                                              ClaimStatus.HELD]
        assert claims[2].lease_expires_at == claims[0].lease_expires_at
    finally:
        engine.dispose()


class FlakyFactory:
    """A session factory whose first ``failures`` transactions fail as a dropped connection does
    (a transient error); ``failures=None``: every one."""

    def __init__(self, real, failures):
        self.real, self.failures = real, failures

    def __call__(self, *args, **kwargs):
        return self.real(*args, **kwargs)

    def begin(self):
        import contextlib

        @contextlib.contextmanager
        def transaction():
            if self.failures is None or self.failures > 0:
                if self.failures is not None:
                    self.failures -= 1
                raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
            with self.real.begin() as session:
                yield session

        return transaction()


class FakeClock:
    """``time`` for group commit: ``sleep`` advances ``monotonic`` and is recorded."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_group_retries_transient_errors_after_1_2_4_seconds_and_refunds_only_what_it_is_told(
        postgres_url, monkeypatch, caplog):
    """Group commit's retry: a transient error puts the whole group back after 1, 2, 4 ... s
    (README "Guarantees"); one transaction then releases two leases, refunding the start of the
    one released for an engine failure only. Groups hold at most ``max_jobs`` writes, and each
    committed group is timed in its lane of ``weir:db_write_latency_seconds``."""
    import time as real_time

    from prometheus_client import CollectorRegistry, Histogram

    from weir.worker import group_commit
    from weir.worker.group_commit import GroupCommitter

    engine = make_engine(postgres_url)
    real = make_session_factory(engine)
    clock = FakeClock()
    monkeypatch.setattr(group_commit, "time", clock)
    latency = Histogram("test_write_latency_seconds", "", ["lane"], registry=CollectorRegistry())
    try:
        with real.begin() as session:
            _, jobs = support.create_batch(session, [GenerateRequest(prompt=p) for p in "pqrstuv"], model="tiny")
            claimed = [support.claim_job(session, job.id, worker="w", lease_s=60) for job in jobs[:2]]
        writer = GroupCommitter(FlakyFactory(real, 3), worker="w", lease_s=60, max_attempts=3,
                                model_name=lambda: "tiny", retry_timeout_s=60, max_wait_s=2.0, max_jobs=2,
                                write_latency_s=latency)
        futures = [writer.release_async(claimed[0], refund_attempt=True), writer.release_async(claimed[1])]
        assert [f.result(timeout=30) for f in futures] == [True, True]
        assert (clock.sleeps, writer.num_transactions) == ([1, 2, 4], 1)
        retried = [r.getMessage() for r in caplog.records if r.name == "weir.worker.group_commit"]
        assert [m.split(" (try ")[0] for m in retried] == [
            f"transient database error, 2 writes retried in {s}s" for s in (1, 2, 4)]
        assert [m.split(" (try ")[1].split(")")[0] for m in retried] == ["2", "3", "4"]  # the try to come
        claims = [writer.claim_async(jobs[2].id)]
        real_time.sleep(0.1)  # within the group's 2 s window: the same transaction
        claims.append(writer.claim_async(jobs[3].id))
        assert [c.result(timeout=30).status for c in claims] == [ClaimStatus.CLAIMED] * 2
        assert writer.num_transactions == 2
        claims = [writer.claim_async(job.id) for job in jobs[4:]]  # three claims, two to a group
        assert [c.result(timeout=30).status for c in claims] == [ClaimStatus.CLAIMED] * 3
        writer.close()
        assert writer.num_transactions == 4 and 0 <= writer.busy_s < 30
        assert not any(thread.is_alive() for thread in writer._threads)
        counts = {s.labels["lane"]: s.value for m in latency.collect() for s in m.samples if s.name.endswith("_count")}
        assert counts == {"claim": 3, "finish": 1}
        with real() as session:
            rows = [session.get(Job, job.id) for job in jobs[:2]]
        assert [(row.status, row.attempts) for row in rows] == [(JobStatus.QUEUED, 0), (JobStatus.QUEUED, 1)]
    finally:
        engine.dispose()


@pytest.mark.parametrize("retry_timeout_s", [30, 25])
def test_a_group_gives_up_once_the_next_retry_would_end_past_its_deadline(postgres_url, monkeypatch,
                                                                          retry_timeout_s):
    """With ``retry_timeout_s`` 30 and the database down: retries after 1, 2, 4, 8 and 10 s (the
    backoff's cap), then :class:`DatabaseUnavailable`, since another 10 s would end past 30 s.
    With 25 s the same: the retry after 10 s ends exactly at the deadline, which is not past it."""
    from weir.worker import group_commit
    from weir.worker.group_commit import GroupCommitter

    engine = make_engine(postgres_url)
    clock = FakeClock()
    monkeypatch.setattr(group_commit, "time", clock)
    try:
        writer = GroupCommitter(FlakyFactory(make_session_factory(engine), None), worker="w", lease_s=60,
                                max_attempts=3, model_name=lambda: "tiny", retry_timeout_s=retry_timeout_s)
        with pytest.raises(group_commit.DatabaseUnavailable, match=f"database unreachable for {retry_timeout_s}s"):
            writer.claim(uuid.uuid4())
        writer.close()
        assert clock.sleeps == [1, 2, 4, 8, 10]
    finally:
        engine.dispose()


@pytest.fixture
def session_factory(postgres_url):
    """A session factory on the test database; its engine disposed at the end."""
    engine = make_engine(postgres_url)
    yield make_session_factory(engine)
    engine.dispose()


def new_jobs(session_factory, prompts):
    with session_factory.begin() as session:
        return support.create_batch(session, [GenerateRequest(prompt=p) for p in prompts], model="tiny")[1]


def committer(session_factory, **kwargs):
    """A GroupCommitter of worker ``w`` (60 s leases, 3 attempts, a 5 s retry budget)."""
    from weir.worker.group_commit import GroupCommitter

    return GroupCommitter(session_factory, worker="w", lease_s=60, max_attempts=3, model_name=lambda: "tiny",
                          retry_timeout_s=5, **kwargs)


def test_a_group_the_database_refuses_for_good_is_written_again_one_by_one(session_factory, caplog):
    """A non-transient error in a group of writes fails only the write that caused it: the
    group is written again one write to a transaction, and the others commit."""
    from sqlalchemy.exc import DataError

    jobs = new_jobs(session_factory, "pqr")
    with session_factory.begin() as session:
        claimed = [support.claim_job(session, job.id, worker="w", lease_s=60) for job in jobs]
    writer = committer(session_factory, max_wait_s=0.5)
    ok = JobResult(status=JobStatus.SUCCEEDED, output_text="x", finish_reason="stop")
    # finish_reason is VARCHAR(16): Postgres refuses this one, and would every time
    bad = JobResult(status=JobStatus.SUCCEEDED, output_text="y", finish_reason="a-reason-far-too-long")
    futures = [writer.finish_async(claimed[0], ok), writer.finish_async(claimed[1], bad),
               writer.finish_async(claimed[2], ok)]
    assert futures[0].result(timeout=30) is True and futures[2].result(timeout=30) is True
    with pytest.raises(DataError, match="value too long"):
        futures[1].result(timeout=30)
    writer.close()
    assert writer.num_transactions == 2  # the two good writes, one by one; the failed tries count none
    assert [r.getMessage() for r in caplog.records if r.name == "weir.worker.group_commit"] == [
        "a group of 3 writes failed ((psycopg.errors.StringDataRightTruncation) value too long for type "
        "character varying(16)); writing them one by one"]
    with session_factory() as session:
        rows = [session.get(Job, job.id) for job in jobs]
    assert [(row.status, row.output_text) for row in rows] == [
        (JobStatus.SUCCEEDED, "x"), (JobStatus.RUNNING, None), (JobStatus.SUCCEEDED, "x")]


def test_a_write_within_a_window_under_a_second_joins_the_group(session_factory):
    """``max_wait_s`` below one second still holds the group open: a claim 0.1 s after the
    first, within a 0.5 s window, shares its transaction."""
    import time

    jobs = new_jobs(session_factory, "pq")
    writer = committer(session_factory, max_wait_s=0.5)
    claims = [writer.claim_async(jobs[0].id)]
    time.sleep(0.1)
    claims.append(writer.claim_async(jobs[1].id))
    assert [c.result(timeout=30).status for c in claims] == [ClaimStatus.CLAIMED] * 2
    writer.close()
    assert writer.num_transactions == 1


def test_a_window_already_over_takes_only_what_is_queued_and_a_closed_writer_refuses(session_factory):
    """With a window shorter than the time to take one write, a group is what is already queued
    (never a wait with a negative timeout); after ``close`` every call raises CommitterStopped."""
    from weir.worker.group_commit import CommitterStopped

    jobs = new_jobs(session_factory, "pq")
    writer = committer(session_factory, max_wait_s=1e-9)
    claims = [writer.claim_async(job.id) for job in jobs]
    assert [c.result(timeout=30).status for c in claims] == [ClaimStatus.CLAIMED] * 2
    writer.close()
    with pytest.raises(CommitterStopped, match="the worker's database writer is closed"):
        writer.claim_async(jobs[0].id)
