"""The client validates everything before it writes, commits rows before it publishes, and
publishes one message per job carrying only the job id, by task name, to the model's queue."""

import threading
import uuid

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from jobs import names, store
from jobs.client import BrokerNotConfigured, Client
from jobs.db import BatchStatus, Job, JobStatus
from jobs.model_info import PromptTooLongError
from jobs.schemas import ClassifyRequest, GenerateRequest
from jobs.store import JobResult
from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings


def published(celery_app, queue):
    """Drain the memory queue: (task name, args) of every message."""
    messages = []
    with celery_app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue, no_ack=True)
        while True:
            try:
                message = simple.get(timeout=0.05)
            except simple.Empty:
                break
            args, kwargs, _ = message.decode()
            messages.append((message.headers["task"], args, kwargs))
        simple.close()
    return messages


def count_jobs(client, **where):
    with client.session_factory() as session:
        stmt = select(func.count()).select_from(Job)
        for column, value in where.items():
            stmt = stmt.where(getattr(Job, column) == value)
        return session.scalar(stmt)


def test_enqueue_batch_commits_rows_then_publishes_job_ids(client, celery_app, queue):
    batch_id = client.enqueue_batch(
        [GenerateRequest(prompt="Hello", custom_id="a"), {"kind": "classify", "prompt": "Tea?", "labels": ["yes", "no"]}],
        metadata={"source": "test"},
    )
    jobs = client.jobs(batch_id)
    assert [(j.custom_id, j.kind.value, j.status, j.model) for j in jobs] == [
        ("a", "generate", JobStatus.QUEUED, "tiny-chat-llama0"),
        ("1", "classify", JobStatus.QUEUED, "tiny-chat-llama0"),
    ]
    assert published(celery_app, queue) == [
        (names.RUN_JOB, [str(jobs[0].id)], {}),
        (names.RUN_JOB, [str(jobs[1].id)], {}),
    ]
    status = client.batch_status(batch_id)
    assert (status.status, status.num_jobs, status.num_finished, status.metadata) == (
        BatchStatus.QUEUED, 2, 0, {"source": "test"})


def test_invalid_request_stores_and_publishes_nothing(client, celery_app, queue):
    before = count_jobs(client)
    with pytest.raises(ValidationError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok"), {"kind": "classify", "prompt": "x", "labels": []}])
    assert [e["loc"] for e in info.value.errors()] == [("labels",)]
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_too_long_prompt_is_refused_at_enqueue(client, celery_app, queue):
    before = count_jobs(client)
    long_prompt = "word " * 600  # the tiny model's max_model_len is 512
    with pytest.raises(PromptTooLongError, match=r"prompt of request long has \d+ tokens; max_model_len=512"):
        client.enqueue_batch([GenerateRequest(prompt="ok"), GenerateRequest(prompt=long_prompt, custom_id="long")])
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_prompt_plus_label_must_fit(client):
    checker = client.prompt_checker
    prompt = "word " * 505
    num_prompt = len(checker.encode(prompt))
    assert num_prompt < 512
    label = "word " * (512 - num_prompt)  # with EOS one token too many
    with pytest.raises(PromptTooLongError, match="prompt plus longest label"):
        checker.check(ClassifyRequest(prompt=prompt, labels=["a", label]))
    assert checker.check(ClassifyRequest(prompt=prompt, labels=["a"])) == num_prompt


def test_duplicate_custom_ids_store_nothing(client, celery_app, queue):
    before = count_jobs(client)
    with pytest.raises(ValueError, match="'x' appears more than once"):
        client.enqueue_batch([GenerateRequest(prompt="a", custom_id="x"), GenerateRequest(prompt="b", custom_id="x")])
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_no_broker_is_refused_before_storing(postgres_url, tiny_model_dir):
    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(broker_url=None),
        database=DatabaseSettings(database_url=postgres_url),
    )
    client = Client(settings)
    before = count_jobs(client)
    with pytest.raises(BrokerNotConfigured, match="WEIR_BROKER_URL"):
        client.enqueue_batch([GenerateRequest(prompt="a")])
    assert count_jobs(client) == before
    client.close()


def test_single_job_enqueue_returns_refs(client, celery_app, queue):
    ref = client.enqueue_generate("Hi", max_tokens=3, temperature=0)
    cls = client.enqueue_classify("Tea?", ["yes", "no"])
    assert [j.id for j in client.jobs(ref.batch_id)] == [ref.job_id]
    assert client.jobs(cls.batch_id)[0].request["labels"] == ["yes", "no"]
    assert [args for _, args, _ in published(celery_app, queue)] == [[str(ref.job_id)], [str(cls.job_id)]]


class Bar:
    def __init__(self):
        self.total, self.n, self.refreshes = None, 0, 0

    def refresh(self):
        self.refreshes += 1


def test_wait_follows_progress_until_finished(client):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a"), GenerateRequest(prompt="b")])

    def finish_all():
        for job in client.jobs(batch_id):
            with client.session_factory.begin() as session:
                claimed = store.claim_job(session, job.id)
            with client.session_factory.begin() as session:
                store.record_result(session, claimed, JobResult(status=JobStatus.SUCCEEDED, output_text="x"))

    threading.Timer(0.3, finish_all).start()
    bar = Bar()
    final = client.wait(batch_id, timeout_s=30, progress=bar, poll_interval_s=0.05)
    assert (final.status, final.num_succeeded, bar.total, bar.n) == (BatchStatus.COMPLETED, 2, 2, 2)
    assert bar.refreshes >= 2
    assert [r["output_text"] for r in client.results(batch_id)] == ["x", "x"]


def test_wait_times_out(client):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    with pytest.raises(TimeoutError, match="still queued after 0.2s: 0/1 jobs finished"):
        client.wait(batch_id, timeout_s=0.2, poll_interval_s=0.05)


def test_unknown_batch(client):
    with pytest.raises(LookupError):
        client.batch_status(uuid.uuid4())


def test_cancel(client):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    assert client.cancel(batch_id).status == BatchStatus.CANCELLED
    assert client.results(batch_id)[0]["status"] == "cancelled"


def test_broker_down_at_publish_raises_and_the_sweeper_publishes_later(postgres_url, tiny_model_dir, queue, celery_app):
    from jobs.client import PublishError

    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(queue=queue, broker_url="redis://127.0.0.1:1/0"),
        database=DatabaseSettings(database_url=postgres_url),
    )
    down = Client(settings)
    with pytest.raises(PublishError, match=r"is stored but 2 jobs were not published .*`weir sweep`") as info:
        down.enqueue_batch([GenerateRequest(prompt="a"), GenerateRequest(prompt="b")])
    batch_id = info.value.batch_id
    jobs = down.jobs(batch_id)
    down.close()
    assert [(j.status, j.published_at) for j in jobs] == [(JobStatus.QUEUED, None)] * 2

    up = Client(settings.model_copy(update={"worker": WorkerSettings(queue=queue)}), celery_app=celery_app)
    assert up.sweep(older_than_s=3600) == 2
    assert up.sweep(older_than_s=3600) == 0  # running it twice is harmless
    assert sorted(args[0] for _, args, _ in published(celery_app, queue)) == sorted(str(j.id) for j in jobs)
    assert all(j.published_at is not None for j in up.jobs(batch_id))
    up.close()


def test_sweep_leaves_a_backlog_alone_and_takes_queued_jobs_once_the_queue_is_empty(client, celery_app, queue):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a"), GenerateRequest(prompt="b")])
    assert client.num_waiting_messages() == 2
    assert client.sweep(older_than_s=0) == 0  # their messages wait in the queue
    assert len(published(celery_app, queue)) == 2  # drained: say Redis lost them
    assert client.num_waiting_messages() == 0
    with client.session_factory() as session:  # the database is shared: other tests left queued jobs
        queued = set(session.scalars(select(Job.id).where(Job.model == client.model, Job.status == JobStatus.QUEUED)))
    assert {j.id for j in client.jobs(batch_id)} <= queued
    assert client.sweep(older_than_s=0) == len(queued)
    assert sorted(args[0] for _, args, _ in published(celery_app, queue)) == sorted(str(i) for i in queued)
