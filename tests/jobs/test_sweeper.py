"""The sweeper on a real Redis queue: it publishes what is lost, whatever the backlog, and never
re-publishes a backlog that is only waiting."""

import json
import os
import uuid

import pytest
import redis as redis_lib

from tests import support
from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
from weir.jobs import claims, names, outbox
from weir.jobs.client import Client
from weir.jobs.schemas import GenerateRequest
from weir.jobs.sweeper import oldest_waiting_job, priority_lists

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_client_and_queue(postgres_url, tiny_model_dir, redis_url, tmp_path):
    # A model name of this test alone (a link to the tiny model): the sweeper takes every lost
    # job of its model, and the database is shared with other tests.
    model_dir = tmp_path / f"sweep-model-{uuid.uuid4().hex[:8]}"
    os.symlink(tiny_model_dir, model_dir)
    queue = f"weir.test-sweep-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        engine=EngineSettings(model=str(model_dir)),
        worker=WorkerSettings(queue=queue, broker_url=redis_url),
        database=DatabaseSettings(database_url=postgres_url),
    )
    client = Client(settings)
    r = redis_lib.Redis.from_url(redis_url)
    # the lists of priority-0 messages (the interactive queue) and of the sweeper's
    yield client, r, names.interactive_queue(queue)
    queues = names.job_queues(queue)
    r.delete(*queues, *(f"_kombu.binding{kind}.{q}" for q in queues for kind in ("", "_permanent")))
    client.close()


def message_job(raw):
    import base64

    envelope = json.loads(raw)
    return json.loads(base64.b64decode(envelope["body"]))[0][0]


def test_a_lost_message_is_published_again_and_the_waiting_backlog_is_not(redis_client_and_queue):
    client, r, queue = redis_client_and_queue
    first = client.enqueue_batch([GenerateRequest(prompt=f"a{i}", custom_id=f"a{i}") for i in range(2)])
    second = client.enqueue_batch([GenerateRequest(prompt=f"b{i}", custom_id=f"b{i}") for i in range(3)])
    a0, a1 = [job.id for job in client.jobs(first)]
    backlog = [job.id for job in client.jobs(second)]
    assert r.llen(queue) == 5
    assert client.sweep(older_than_s=0) == 0  # everything waits in the queue: nothing is lost
    with client.celery_app.connection_for_read() as connection:
        assert oldest_waiting_job(connection, queue) == a0

    # A worker takes a1's message and claims it; a0's message is lost (a key deleted by hand, or
    # a worker killed before kombu recorded it as unacked).
    assert message_job(r.rpop(queue)) == str(a0)
    assert message_job(r.rpop(queue)) == str(a1)
    with client.session_factory.begin() as session:
        assert support.claim_job(session, a1, worker="w", lease_s=60) is not None
    # The queue has moved past a0 (its oldest message is now b0's, published later): a0 is lost,
    # and published again to the control queue, ahead of the backlog.
    control = names.control_queue(client.queue)
    assert client.sweep(older_than_s=0) == 1
    assert [message_job(m) for m in r.lrange(control, 0, -1)] == [str(a0)]
    assert client.sweep(older_than_s=0) == 0  # a0 now waits too
    assert [message_job(m) for m in r.lrange(queue, 0, -1)] == [str(i) for i in reversed(backlog)]  # never twice
    # Workers take the backlog; a0's new message is lost as well. With a grace, a loss is only
    # declared that long after the queue moved past it.
    for job_id in backlog:
        assert message_job(r.rpop(queue)) == str(job_id)
        with client.session_factory.begin() as session:
            support.claim_job(session, job_id, worker="w", lease_s=60)
    assert message_job(r.rpop(control)) == str(a0) and r.llen(queue) == r.llen(control) == 0
    assert client.sweep(older_than_s=3600) == 0
    assert client.sweep(older_than_s=0) == 1
    assert [message_job(m) for m in r.lrange(control, 0, -1)] == [str(a0)]


SWEEP_AT = """
import sys, time
from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
from weir.jobs.client import Client

model, queue, broker_url, database_url, start_at = sys.argv[1:]
client = Client(Settings(engine=EngineSettings(model=model), worker=WorkerSettings(queue=queue, broker_url=broker_url),
                         database=DatabaseSettings(database_url=database_url)))
client.celery_app.connection_for_write().ensure_connection()  # connected before the start
time.sleep(max(0.0, float(start_at) - time.time()))
print(client.sweep(older_than_s=3600, limit=100_000))
"""


def test_two_sweepers_at_once_publish_each_lost_job_once(redis_client_and_queue, postgres_url, redis_url):
    """Two sweeper processes start the same instant over 10,000 jobs whose publish failed: each job
    is published again exactly once (the sweeper's read locks the rows it takes; without the lock
    both publish most of them)."""
    import subprocess
    import sys
    import time

    from sqlalchemy import update

    from weir.jobs.db import Job

    client, r, interactive = redis_client_and_queue
    num_jobs = 10_000
    batch_id = client.enqueue_batch(GenerateRequest(prompt=f"p{i}", custom_id=f"p{i}", max_tokens=1)
                                    for i in range(num_jobs))
    r.delete(interactive)  # the publish "failed": no message, published_at null
    with client.session_factory.begin() as session:
        session.execute(update(Job).where(Job.batch_id == batch_id).values(published_at=None))
    start_at = time.time() + 6.0
    sweepers = [subprocess.Popen([sys.executable, "-c", SWEEP_AT, client.settings.engine.model, client.queue,
                                  redis_url, postgres_url, str(start_at)], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    counts = [int(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in sweepers]
    published = [message_job(m) for m in r.lrange(names.control_queue(client.queue), 0, -1)]
    assert sum(counts) == len(published)
    assert sorted(published) == sorted(str(job.id) for job in client.jobs(batch_id))  # each once


def test_a_second_sweeper_skips_the_rows_a_first_one_holds_instead_of_waiting(redis_client_and_queue):
    """While one sweep's transaction holds the lost jobs it took, a second sweep takes the others
    at once (``SKIP LOCKED``) instead of waiting for the first to commit (a plain ``FOR UPDATE``
    would block it, here past a 2 s lock timeout)."""
    from datetime import timedelta

    from sqlalchemy import text, update

    from weir.jobs.db import Job, utcnow

    client, r, interactive = redis_client_and_queue
    batch_id = client.enqueue_batch(GenerateRequest(prompt=f"p{i}", max_tokens=1) for i in range(6))
    r.delete(interactive)
    with client.session_factory.begin() as session:
        session.execute(update(Job).where(Job.batch_id == batch_id).values(published_at=None))
    model, older_than = client.model, utcnow() - timedelta(seconds=60)
    with client.session_factory() as first, client.session_factory() as second:
        held = outbox.take_jobs_to_publish(first, model=model, older_than=older_than, limit=4)
        second.execute(text("SET lock_timeout = '2s'"))
        rest = outbox.take_jobs_to_publish(second, model=model, older_than=older_than, limit=6)
        second.commit()
        first.commit()
    assert len(held) == 4 and sorted(held + rest) == sorted(job.id for job in client.jobs(batch_id))


def test_jobs_of_a_waiting_chunk_are_not_lost(redis_client_and_queue):
    """A bulk batch waits as chunk messages: the oldest waiting job is the first of the oldest
    chunk, so the sweeper takes none of the jobs whose chunk still waits; once a worker took the
    first chunk and claimed its jobs, still none."""
    from weir.jobs.schemas import BULK_PRIORITY

    client, r, _ = redis_client_and_queue
    chunked = Client(client.settings.model_copy(update={
        "worker": client.settings.worker.model_copy(update={"bulk_chunk_size": 4})}))
    try:
        batch_id = chunked.enqueue_batch([GenerateRequest(prompt=f"p{i}", max_tokens=1) for i in range(8)],
                                         priority=BULK_PRIORITY)
        jobs = [job.id for job in chunked.jobs(batch_id)]
        with chunked.celery_app.connection_for_read() as connection:
            [bulk_list] = [q for q in priority_lists(connection, names.bulk_queue(chunked.queue)) if r.llen(q)]
            assert r.llen(bulk_list) == 2
            assert oldest_waiting_job(connection, bulk_list) == jobs[0]
        assert chunked.sweep(older_than_s=0) == 0
        r.rpop(bulk_list)  # a worker takes the first chunk and claims its jobs
        with chunked.session_factory.begin() as session:
            claims.claim_jobs(session, jobs[:4], worker="w", lease_s=60)
        assert chunked.sweep(older_than_s=0) == 0
    finally:
        chunked.close()


def test_the_oldest_waiting_job_is_found_behind_other_tasks_and_unreadable_messages(redis_client_and_queue):
    client, r, _ = redis_client_and_queue
    queue = f"{client.queue}.scan"
    job_id = uuid.uuid4()
    try:
        client.celery_app.send_task(names.SWEEP, queue=queue)  # the oldest: not a job's message
        client.celery_app.send_task(names.RUN_JOB, args=[], queue=queue)  # no job id in it
        client.celery_app.send_task(names.RUN_JOB, args=["not-a-uuid"], queue=queue)
        client.celery_app.send_task(names.RUN_JOB, args=[str(job_id)], queue=queue)
        with client.celery_app.connection_for_read() as connection:
            assert oldest_waiting_job(connection, queue) == job_id
    finally:
        r.delete(queue)


def test_the_queue_position_is_the_furthest_a_sweep_saw_within_one_publish(redis_client_and_queue):
    """One publish sends a batch's messages under one time: a later sweep that sees the queue
    further into that batch (a higher index) moves the horizon there, so the jobs before it whose
    messages are gone are lost."""
    client, r, queue = redis_client_and_queue
    batch_id = client.enqueue_batch([GenerateRequest(prompt=f"p{i}", max_tokens=1) for i in range(5)])
    jobs = [job.id for job in client.jobs(batch_id)]
    assert client.sweep(older_than_s=0) == 0  # records the head: job 0
    for job_id in jobs[:3]:  # taken by a worker that died before it claimed them
        assert message_job(r.rpop(queue)) == str(job_id)
    control = names.control_queue(client.queue)
    assert client.sweep(older_than_s=0) == 3  # the head is now job 3, published with jobs 0-2
    assert sorted(message_job(m) for m in r.lrange(control, 0, -1)) == sorted(str(j) for j in jobs[:3])


def test_every_sweep_runs_the_applications_rules_and_a_rule_that_raises_stops_no_other(
        redis_client_and_queue, monkeypatch, caplog):
    from weir.jobs import applications

    client, _, _ = redis_client_and_queue
    calls = []

    def broken(session, *, model, now):
        calls.append(("broken", model))
        raise RuntimeError("no such table")

    def counting(session, *, model, now):
        calls.append(("counting", model))
        return 2

    rules = {applications.SWEEP_RULES: {"broken": broken, "counting": counting}}
    monkeypatch.setattr(applications, "load_each", lambda group: rules.get(group, {}))
    assert client.sweep() == 0
    assert calls == [("broken", client.model), ("counting", client.model)]
    assert "sweep: rule broken failed" in caplog.text and "sweep: rule counting changed 2" in caplog.text


def test_the_openai_batch_expiry_is_registered_as_a_sweep_rule():
    from weir.jobs import applications, openai_batch

    assert applications.load(applications.SWEEP_RULES) == {"openai_batch_expiry": openai_batch.expire_due_batches}
