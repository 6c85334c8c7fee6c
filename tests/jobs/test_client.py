"""The client reaches the broker before it writes, validates and stores a batch chunk by chunk
while the batch is ``validating`` (an error leaves nothing), publishes only once every row is
committed, one message per job carrying only the job id, by task name, to the model's queue, and
streams results back in submission order."""

import json
import threading
import time
import uuid

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from tests import support
from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
from weir.jobs import batches, claims, client as client_module, names
from weir.jobs.client import BrokerNotConfigured, BrokerUnreachable, Client, PublishError
from weir.jobs.db import Batch, BatchStatus, Job, JobStatus
from weir.jobs.model_info import EngineLimitError, PromptTooLongError
from weir.jobs.results import JobResult
from weir.jobs.schemas import ClassifyRequest, GenerateRequest


def published(celery_app, queue):
    """Drain the memory queue ``queue`` and its interactive queue (where priority-0 jobs go):
    (task name, args) of every message."""
    messages = []
    with celery_app.connection_for_read() as connection:
        for name in (queue, names.interactive_queue(queue)):
            simple = connection.SimpleQueue(name, no_ack=True)
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


@pytest.mark.parametrize("priority, error", [
    (True, "int_type"), ("1", "int_type"), (1.0, "int_type"), (2**31, "less_than_equal"),
    (-(2**31) - 1, "greater_than_equal")])
def test_a_batch_priority_is_checked_as_a_request_priority_is_before_anything_is_stored(
        client, celery_app, queue, priority, error):
    before = count_jobs(client)
    with pytest.raises(ValidationError) as batch_info:
        client.enqueue_batch([GenerateRequest(prompt="ok")], priority=priority)
    with pytest.raises(ValidationError) as request_info:
        GenerateRequest(prompt="ok", priority=priority)
    assert [e["type"] for e in batch_info.value.errors()] == [error]
    assert [e["type"] for e in request_info.value.errors()] == [error]
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_too_long_prompt_is_refused_at_enqueue(client, celery_app, queue):
    before = count_jobs(client)
    long_prompt = "word " * 600  # the tiny model's max_model_len is 512
    with pytest.raises(PromptTooLongError, match=r"^request long: prompt has \d+ tokens; max_model_len=512 "):
        client.enqueue_batch([GenerateRequest(prompt="ok"), GenerateRequest(prompt=long_prompt, custom_id="long")])
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


@pytest.mark.parametrize("max_tokens, message", [
    (10**9, r"request big: max_tokens=1000000000 is more than max_model_len=512 \(batch index 1\)"),
    (511, r"request big: prompt \(2 tokens\) plus max_tokens=511 is 513 tokens, more than max_model_len=512 "
          r"\(batch index 1\)"),
])
def test_max_tokens_beyond_max_model_len_is_refused_at_enqueue(client, celery_app, queue, max_tokens, message):
    assert len(client.prompt_checker.encode("One two")) == 2
    before = count_jobs(client)
    with pytest.raises(PromptTooLongError, match=message):
        client.enqueue_batch([GenerateRequest(prompt="ok"),
                              GenerateRequest(prompt="One two", custom_id="big", max_tokens=max_tokens)])
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []
    assert client.prompt_checker.check(GenerateRequest(prompt="One two", max_tokens=510)) == 2


@pytest.mark.parametrize("fields, message", [
    ({"logprobs": 21}, "request big: logprobs=21 is more than max_logprobs=20 (WEIR_MAX_LOGPROBS) (batch index 1)"),
    ({"prompt_logprobs": 100},
     "request big: prompt_logprobs=100 is more than max_logprobs=20 (WEIR_MAX_LOGPROBS) (batch index 1)"),
    ({"stop_token_ids": [2, 49152, 10**6]},
     "request big: stop_token_ids outside the vocabulary [0, 49152): [49152, 1000000] (batch index 1)"),
    ({"extensions": {"enrichment": {"catalog": "c.csv", "product_id": "1", "retry_sampling": {"logprobs": 30}}}},
     "request big: extensions.enrichment.retry_sampling.logprobs=30 is more than max_logprobs=20 "
     "(WEIR_MAX_LOGPROBS) (batch index 1)"),
])
def test_engine_limits_are_refused_at_enqueue(client, celery_app, queue, fields, message):
    before = count_jobs(client)
    with pytest.raises(EngineLimitError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok"), GenerateRequest(prompt="x", custom_id="big", **fields)])
    assert str(info.value) == message
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []
    # the limits themselves are allowed
    assert client.prompt_checker.check(GenerateRequest(prompt="One two", logprobs=20, prompt_logprobs=20,
                                                       stop_token_ids=[0, 49151])) == 2


def test_max_logprobs_is_the_setting(postgres_url, tiny_model_dir, celery_app):
    settings = Settings(engine=EngineSettings(model=tiny_model_dir, max_logprobs=0),
                        database=DatabaseSettings(database_url=postgres_url))
    client = Client(settings, celery_app=celery_app)
    try:
        with pytest.raises(EngineLimitError) as info:
            client.validate([GenerateRequest(prompt="x", logprobs=1)])
    finally:
        client.close()
    assert str(info.value) == ("request without custom_id: logprobs=1 is more than max_logprobs=0 (WEIR_MAX_LOGPROBS) "
                               "(batch index 0)")


def test_an_unsupported_schema_is_refused_before_anything_is_stored(client, celery_app, queue):
    before = count_jobs(client)
    bad = {"kind": "generate", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "item", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}
    with pytest.raises(ValidationError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok"), bad])
    [error] = info.value.errors()
    assert error["loc"] == ("response_format", "json_schema", "schema")
    assert error["msg"].startswith("response_format.json_schema.schema is not supported: ")
    assert info.value.__notes__ == ["request at batch index 1"]
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_prompt_plus_label_must_fit(client):
    checker = client.prompt_checker
    prompt = "word " * 505
    num_prompt = len(checker.encode(prompt))
    assert num_prompt < 512
    label = "word " * (512 - num_prompt)  # with EOS one token too many
    with pytest.raises(PromptTooLongError, match=r"^request without custom_id: prompt plus longest label has 514 tokens, "
                                                  r"more than max_model_len=512$"):
        checker.check(ClassifyRequest(prompt=prompt, labels=["a", label]))
    assert checker.check(ClassifyRequest(prompt=prompt, labels=["a"])) == num_prompt


def test_duplicate_custom_ids_store_nothing(client, celery_app, queue):
    before = count_jobs(client)
    with pytest.raises(ValueError, match="'x' appears more than once"):
        client.enqueue_batch([GenerateRequest(prompt="a", custom_id="x"), GenerateRequest(prompt="b", custom_id="x")])
    assert count_jobs(client) == before
    assert published(celery_app, queue) == []


def test_without_a_broker_what_needs_one_says_so_in_one_line(tmp_path, tiny_model_dir):
    # enqueue_batch runs its jobs in-process instead (test_readme_quickstart); these need a real broker
    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(broker_url=None),
        database=DatabaseSettings(database_url=f"sqlite:///{tmp_path / 'w.db'}"),
    )
    client = Client(settings)
    try:
        for call in (client.sweep, client.queue_consumers, client.num_waiting_messages):
            with pytest.raises(BrokerNotConfigured) as raised:
                call()
            assert str(raised.value) == "no broker: set WEIR_BROKER_URL (e.g. redis://127.0.0.1:6379/0)"
    finally:
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
                claimed = support.claim_job(session, job.id)
            with client.session_factory.begin() as session:
                support.record_result(session, claimed, JobResult(status=JobStatus.SUCCEEDED, output_text="x"))

    threading.Timer(0.3, finish_all).start()
    bar = Bar()
    final = client.wait(batch_id, timeout_s=30, progress=bar, poll_interval_s=0.05)
    assert (final.status, final.num_succeeded, bar.total, bar.n) == (BatchStatus.COMPLETED, 2, 2, 2)
    assert bar.refreshes >= 2
    assert [r["output_text"] for r in client.results(batch_id)] == ["x", "x"]


def finish_batch(client, batch_id):
    for job in client.jobs(batch_id):
        with client.session_factory.begin() as session:
            claimed = support.claim_job(session, job.id)
        with client.session_factory.begin() as session:
            support.record_result(session, claimed, JobResult(status=JobStatus.SUCCEEDED, output_text="x"))


def test_wait_is_woken_by_the_batch_channel_not_its_next_poll(client):
    """An hour between polls and no timeout: the wait still returns once the batch finishes,
    because the ``weir_batch`` notification ends the wait between polls (a wait left to its
    polls would still be asleep when the join below gives up)."""
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    finals = []
    waiter = threading.Thread(target=lambda: finals.append(client.wait(batch_id, poll_interval_s=3600)), daemon=True)
    waiter.start()
    time.sleep(0.3)
    finish_batch(client, batch_id)
    waiter.join(timeout=20)
    assert [(f.status, f.num_succeeded) for f in finals] == [(BatchStatus.COMPLETED, 1)]


def test_the_batch_channel_wakes_a_wait_for_its_own_batch_only_and_gives_its_connection_back(client):
    from weir.jobs.db import make_engine

    engine = make_engine(client.engine.url.render_as_string(hide_password=False), pool_size=1)
    channel = batches.BatchChannel(engine)
    ours = client.enqueue_batch([GenerateRequest(prompt="a")])
    other = client.enqueue_batch([GenerateRequest(prompt="b")])
    try:
        with channel.subscribe(ours) as changes:
            assert channel.listening
            finish_batch(client, other)
            assert changes.wait(0.5) is False  # another batch's change is read and dropped
            finish_batch(client, ours)
            assert changes.wait(20) is True
        channel.close()
        assert not channel.listening
        with engine.connect() as conn:  # the pool's connection, UNLISTENed
            assert conn.exec_driver_sql("SELECT count(*) FROM pg_listening_channels()").scalar() == 0
    finally:
        channel.close()
        engine.dispose()


def test_many_waits_share_one_listening_connection(postgres_url, tiny_model_dir, queue, celery_app):
    """Six waits at once on a client whose pool holds two connections (one and one overflow): a
    connection per wait would leave none to read the batches with. Each wait polls once an hour,
    so only the channel can end them."""
    settings = Settings(engine=EngineSettings(model=tiny_model_dir), worker=WorkerSettings(queue=queue, broker_url=None),
                        database=DatabaseSettings(database_url=postgres_url, pool_size=1, pool_timeout_s=1))
    client = Client(settings, celery_app=celery_app)
    try:
        ids = [client.enqueue_batch([GenerateRequest(prompt=f"p{i}")]) for i in range(6)]
        finals = []
        waiters = [threading.Thread(target=lambda b=b: finals.append(client.wait(b, poll_interval_s=3600)), daemon=True)
                   for b in ids]
        for waiter in waiters:
            waiter.start()
        time.sleep(0.5)
        for batch_id in ids:
            finish_batch(client, batch_id)
        for waiter in waiters:
            waiter.join(timeout=20)
        assert sorted((f.status, f.num_succeeded) for f in finals) == [(BatchStatus.COMPLETED, 1)] * 6
    finally:
        client.close()


def test_a_wait_on_sqlite_sleeps_out_its_poll_interval(tmp_path):
    from weir.jobs.db import make_engine

    engine = make_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    channel = batches.BatchChannel(engine)
    with channel.subscribe(uuid.uuid4()) as changes:
        start = time.monotonic()
        assert (channel.listening, changes.wait(0.1)) == (False, False)
        assert time.monotonic() - start >= 0.1
    channel.close()
    engine.dispose()


def test_wait_times_out(client):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    with pytest.raises(TimeoutError, match="still queued after 0.2s: 0/1 jobs finished"):
        client.wait(batch_id, timeout_s=0.2, poll_interval_s=0.05)


def test_unknown_batch(client):
    with pytest.raises(LookupError):
        client.batch_status(uuid.uuid4())
    with pytest.raises(LookupError):  # not an empty result
        list(client.results(uuid.uuid4()))


def test_cancel(client):
    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    assert client.cancel(batch_id).status == BatchStatus.CANCELLED
    [row] = client.results(batch_id)
    assert row["status"] == "cancelled"


def test_cancel_that_loses_a_deadlock_to_a_worker_runs_again(client):
    """A worker's transaction holds the batch's last job and then asks for its first while the
    cancel, which locks in id order, holds the first and waits on the last. The cancel waited first,
    so Postgres picks it as the deadlock victim (after ``deadlock_timeout``, 1 s); it runs again."""
    from sqlalchemy import text

    batch_id = client.enqueue_batch([GenerateRequest(prompt="a"), GenerateRequest(prompt="b")])
    first, last = sorted(j.id for j in client.jobs(batch_id))
    holding, done = threading.Event(), threading.Event()
    touch = text("UPDATE jobs SET attempts = attempts WHERE id = :id")

    def worker():
        with client.engine.begin() as conn:
            conn.execute(touch, {"id": last})
            holding.set()
            time.sleep(0.3)  # the cancel now holds the first job and waits on the last
            conn.execute(touch, {"id": first})
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert holding.wait(10)
    progress = client.cancel(batch_id)
    thread.join(10)
    assert done.is_set()
    assert progress.status == BatchStatus.CANCELLED and progress.num_cancelled == 2
    assert [row["status"] for row in client.results(batch_id)] == ["cancelled", "cancelled"]


def test_broker_down_at_publish_raises_and_the_sweeper_publishes_later(
        postgres_url, tiny_model_dir, queue, celery_app, monkeypatch):
    from weir.jobs.client import PublishError

    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(queue=queue, broker_url="redis://127.0.0.1:1/0"),
        database=DatabaseSettings(database_url=postgres_url),
    )
    monkeypatch.setattr(client_module, "_check_broker", lambda app: None)  # it answered, then went away
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
    # Published again to the control queue, which every worker also consumes, ahead of any backlog.
    assert published(celery_app, queue) == []
    assert sorted(args[0] for _, args, _ in published(celery_app, names.control_queue(queue))) == sorted(
        str(j.id) for j in jobs)
    assert all(j.published_at is not None for j in up.jobs(batch_id))
    up.close()


# ---- streaming: broker first, chunks while validating, nothing left on error ---------------------


def new_batches(client, before):
    """(status, num_jobs, jobs stored) of each batch not in ``before``."""
    with client.session_factory() as session:
        batches = session.execute(select(Batch.id, Batch.status, Batch.num_jobs).where(Batch.id.not_in(before))).all()
        return [(status.value, num_jobs, session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == id_)))
                for id_, status, num_jobs in batches]


def batch_ids(client):
    with client.session_factory() as session:
        return set(session.scalars(select(Batch.id)))


def requests(n):
    return [GenerateRequest(prompt=f"p{i}", custom_id=f"c{i}") for i in range(n)]


def test_a_wrong_broker_url_stores_nothing_and_says_so_in_one_line(postgres_url, tiny_model_dir, queue):
    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(queue=queue, broker_url="redis://127.0.0.1:1/0"),
        database=DatabaseSettings(database_url=postgres_url),
    )
    client = Client(settings)
    before, num_jobs = batch_ids(client), count_jobs(client)
    read = []

    def generate():
        for i, request in enumerate(requests(10)):
            read.append(i)
            yield request

    with pytest.raises(BrokerUnreachable) as info:
        client.enqueue_batch(generate(), chunk_size=2)
    message = str(info.value)
    assert "\n" not in message and info.value.__suppress_context__
    assert message.startswith("cannot reach the broker at redis://127.0.0.1:1/0 (")
    assert message.endswith("); nothing was stored")
    assert read == [0]  # only the peek for an empty batch: nothing validated
    assert new_batches(client, before) == [] and count_jobs(client) == num_jobs
    client.close()


@pytest.mark.parametrize("bad_index, bad, error, match", [
    (3, {"kind": "classify", "prompt": "x", "labels": []}, ValidationError, "labels"),
    (4, GenerateRequest(prompt="word " * 600, custom_id="long"), PromptTooLongError,
     r"request long: prompt has \d+ tokens; max_model_len=512 leaves no room for output \(batch index 4\)"),
    (5, GenerateRequest(prompt="again", custom_id="c1"), ValueError,
     r"custom_id 'c1' appears more than once in the batch \(batch index 5\)"),
])
def test_an_error_in_a_later_chunk_deletes_the_stored_chunks_and_publishes_nothing(
        client, celery_app, queue, bad_index, bad, error, match):
    before, num_jobs = batch_ids(client), count_jobs(client)
    seen = []

    def generate():
        for i in range(6):
            seen.append(new_batches(client, before))
            yield bad if i == bad_index else GenerateRequest(prompt=f"p{i}", custom_id=f"c{i}")

    with pytest.raises(error, match=match) as info:
        client.enqueue_batch(generate(), chunk_size=2)  # 3 chunks
    if error is ValidationError:
        assert info.value.__notes__ == ["request at batch index 3"]
    assert seen[bad_index] == [("validating", 0, 2 * (bad_index // 2))]  # earlier chunks were stored
    assert new_batches(client, before) == [] and count_jobs(client) == num_jobs
    assert published(celery_app, queue) == []


def test_a_batch_stays_validating_until_every_job_is_stored(client, celery_app, queue):
    before = batch_ids(client)
    seen = []

    def generate():
        for request in requests(5):
            seen.append((new_batches(client, before), client.num_waiting_messages()))
            yield request

    batch_id = client.enqueue_batch(generate(), chunk_size=2)
    assert seen == [
        ([], 0),  # the first request is read before the batch row exists
        ([("validating", 0, 0)], 0),
        ([("validating", 0, 2)], 0),
        ([("validating", 0, 2)], 0),
        ([("validating", 0, 4)], 0),
    ]
    assert new_batches(client, before) == [("queued", 5, 5)]
    jobs = client.jobs(batch_id)
    assert [args for _, args, _ in published(celery_app, queue)] == [[str(j.id)] for j in jobs]
    assert all(j.published_at is not None for j in jobs)


def test_an_idempotency_key_enqueues_one_batch(client, celery_app, queue):
    key = f"nightly-{uuid.uuid4().hex}"
    first = client.enqueue_batch(requests(2), idempotency_key=key)
    read = []

    def generate():
        for i, request in enumerate(requests(3)):
            read.append(i)
            yield request

    assert client.enqueue_batch(generate(), idempotency_key=key) == first
    assert read == [0]
    with client.session_factory() as session:
        assert session.scalars(select(Batch.id).where(Batch.idempotency_key == key)).all() == [first]
    assert len(client.jobs(first)) == 2
    assert len(published(celery_app, queue)) == 2


def test_an_idempotency_key_taken_meanwhile_returns_the_other_batch(client, celery_app, queue):
    """The race on the key: the second producer's insert hits the unique constraint."""
    key = f"nightly-{uuid.uuid4().hex}"
    second = []

    def generate():
        yield GenerateRequest(prompt="a")
        # The first batch's row is committed, still validating: another producer comes now.
        second.append(client.enqueue_batch(requests(3), idempotency_key=key))
        yield GenerateRequest(prompt="b")

    first = client.enqueue_batch(generate(), idempotency_key=key)
    assert second == [first]
    assert [j.request["prompt"] for j in client.jobs(first)] == ["a", "b"]
    assert len(published(celery_app, queue)) == 2


def test_results_stream_in_submission_order(client):
    custom_ids = ["z", "b", "y", "a", "x", "c", "w"]
    batch_id = client.enqueue_batch([GenerateRequest(prompt="p", custom_id=c) for c in custom_ids], chunk_size=3)
    results = client.results(batch_id, page_size=2)
    assert iter(results) is results  # a generator, read page by page
    assert [r["custom_id"] for r in results] == custom_ids
    assert [j.batch_index for j in client.iter_jobs(batch_id, page_size=3)] == list(range(7))


def test_a_publish_that_fails_part_way_marks_only_the_rest_unpublished(client, celery_app, queue, monkeypatch):
    from weir.jobs.publisher import JobPublisher

    calls = []
    publish = JobPublisher.publish

    def fail_second(self, job_ids):
        calls.append(len(job_ids))
        if len(calls) == 2:
            raise ConnectionError("broker gone")
        publish(self, job_ids)

    monkeypatch.setattr(JobPublisher, "publish", fail_second)
    unpublished = r"is stored but 3 jobs were not published \(ConnectionError: broker gone\)"
    with pytest.raises(PublishError, match=unpublished) as info:
        client.enqueue_batch(requests(5), chunk_size=2)
    assert calls == [2, 2]
    jobs = client.jobs(info.value.batch_id)
    assert [j.published_at is not None for j in jobs] == [True, True, False, False, False]
    assert [args for _, args, _ in published(celery_app, queue)] == [[str(jobs[0].id)], [str(jobs[1].id)]]


def test_batch_length_checks_count_as_single_checks(client):
    checker = client.prompt_checker
    batch = [
        GenerateRequest(prompt="Product: Green Tea\nBrand: Leafy"),
        GenerateRequest(prompt="Hello", system_prompt="Be brief."),
        ClassifyRequest(prompt=[{"role": "user", "content": "Tea?"}], labels=["yes", "no"]),
        ClassifyRequest(prompt="Tea?", labels=["a", "b"], label_texts=[" yes", " no"]),
    ]
    assert checker.check_batch(batch) == [checker.check(r) for r in batch] == [
        len(checker.encode(r.engine_prompt())) for r in batch]


def test_add_jobs_refuses_a_custom_id_the_batch_already_has_and_keeps_the_rest(session_factory):
    with session_factory.begin() as session:
        batch = batches.begin_batch(session, model="tiny")
        batches.add_jobs(session, batch.id, requests(2), first_index=0, model="tiny", published_at=None)
        with pytest.raises(ValueError, match=r"custom_id 'c1' appears more than once in the batch \(batch index 3\)"):
            batches.add_jobs(session, batch.id, [GenerateRequest(prompt="x", custom_id="new"),
                                               GenerateRequest(prompt="y", custom_id="c1")],
                             first_index=2, model="tiny", published_at=None)
        batches.queue_batch(session, batch.id, 2)
    with session_factory() as session:
        assert [(j.batch_index, j.custom_id) for j in batches.list_jobs(session, batch.id)] == [(0, "c0"), (1, "c1")]
        stored = batches.get_batch(session, batch.id)
        assert (stored.status, stored.num_jobs) == (BatchStatus.QUEUED, 2)


def test_published_jobs_send_task_sent_events_as_send_task_does(redis_url, queue):
    """A Celery event receiver (what Flower runs) gets one ``task-sent`` per job, with the fields
    ``apply_async`` gives it, once the app's ``task_send_sent_event`` is on (the client's with
    ``WEIR_TASK_SEND_SENT_EVENT=true``)."""
    import redis
    from celery import Celery

    from weir.jobs.publisher import JobPublisher

    app = Celery("weir-test-sent-events", broker=redis_url, set_as_current=False)
    app.conf.task_send_sent_event = True
    events: list[dict] = []
    connection = app.connection_for_read()
    receiver = app.events.Receiver(connection, handlers={"task-sent": events.append})
    capture = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
    capture.start()
    broker = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while not any(receiver.queue.name.encode() in b for b in broker.smembers("_kombu.binding.celeryev")):
        assert time.monotonic() < deadline, "the event receiver never bound its queue"
        time.sleep(0.02)
    job_ids = [uuid.uuid4() for _ in range(5)]
    try:
        with JobPublisher(app, queue) as publisher:
            publisher.publish(job_ids[:3])
            publisher.publish(job_ids[3:])
        messages = published(app, queue)
        while len(events) < len(job_ids) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        receiver.should_stop = True
        capture.join(5)
        connection.release()
        broker.delete(queue, f"_kombu.binding.{queue}")
    assert messages == [(names.RUN_JOB, [str(j)], {}) for j in job_ids]
    assert [(e["name"], e["args"], e["kwargs"], e["queue"], e["exchange"], e["routing_key"], e["retries"])
            for e in events] == [(names.RUN_JOB, f"['{j}']", "{}", queue, "", queue, 0) for j in job_ids]
    assert len({e["uuid"] for e in events}) == len(job_ids)
    assert not Client(Settings(worker=WorkerSettings(broker_url=redis_url))).celery_app.conf.task_send_sent_event
    on = WorkerSettings(broker_url=redis_url, task_send_sent_event=True)
    assert Client(Settings(worker=on)).celery_app.conf.task_send_sent_event


def test_no_task_sent_event_when_the_app_sends_none(redis_url, queue):
    from unittest import mock

    from celery import Celery

    from weir.jobs.publisher import JobPublisher

    app = Celery("weir-test-no-sent-events", broker=redis_url, set_as_current=False)  # Celery's default: off
    try:
        with mock.patch.object(app.events.Dispatcher, "publish") as publish_event:
            with JobPublisher(app, queue) as publisher:
                publisher.publish([uuid.uuid4()])
    finally:
        import redis

        redis.Redis.from_url(redis_url).delete(queue, f"_kombu.binding.{queue}")
    assert publish_event.call_count == 0


def test_messages_on_redis_are_celery_task_messages_in_order(redis_url, queue):
    import redis
    from celery import Celery

    from weir.jobs.publisher import JobPublisher

    app = Celery("weir-test-redis-producer", broker=redis_url, set_as_current=False)
    job_ids = [uuid.uuid4() for _ in range(7)]
    try:
        with JobPublisher(app, queue) as publisher:
            for start in range(0, 7, 3):  # 3 pipelined round trips
                publisher.publish(job_ids[start:start + 3])
        app.send_task(names.RUN_JOB, args=["reference"], queue=queue)
        envelopes = [json.loads(e) for e in reversed(redis.Redis.from_url(redis_url).lrange(queue, 0, -1))]
        messages = published(app, queue)
    finally:
        redis.Redis.from_url(redis_url).delete(queue, f"_kombu.binding.{queue}")
    assert messages == [(names.RUN_JOB, [str(j)], {}) for j in job_ids] + [(names.RUN_JOB, ["reference"], {})]
    ours, reference = envelopes[0], envelopes[-1]  # the same layout as send_task's, field for field
    assert sorted(ours) == sorted(reference)
    assert sorted(ours["headers"]) == sorted(reference["headers"])
    assert sorted(ours["properties"]) == sorted(reference["properties"])
    assert ours["properties"]["delivery_info"] == reference["properties"]["delivery_info"] == {
        "exchange": "", "routing_key": queue}


def _index_names(plan) -> set:
    """Every index a JSON ``EXPLAIN`` plan reads."""
    found = {plan["Index Name"]} if "Index Name" in plan else set()
    for child in plan.get("Plans", []):
        found |= _index_names(child)
    return found


def test_a_large_batch_refreshes_the_statistics_so_a_claim_looks_its_jobs_up_by_id(tiny_model_dir, celery_app, queue):
    """Without fresh statistics the planner believes few jobs queued and reads every queued job
    through the status index for each claim (a claim's cost then grows with the backlog)."""
    import datetime

    from sqlalchemy import text

    from tests import support

    with support.fresh_postgres_database() as url:
        client = Client(Settings(engine=EngineSettings(model=tiny_model_dir),
                                 worker=WorkerSettings(queue=queue, broker_url=None),
                                 database=DatabaseSettings(database_url=url)), celery_app=celery_app)
        try:
            batch_id = client.enqueue_batch(requests(client_module.ANALYZE_AFTER_NUM_JOBS))
            with client.session_factory() as session:
                ids = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id, Job.batch_index < 8)))
                now = datetime.datetime.now(datetime.timezone.utc)
                [plan] = session.execute(text("EXPLAIN (FORMAT JSON) " + claims._claim_sql("postgresql", "claim").text),
                                           dict(ids=ids, now=now, expires=now, worker="w", max_attempts=3)).scalar()
                last_analyze = session.scalar(text("SELECT last_analyze FROM pg_stat_user_tables WHERE relname = 'jobs'"))
        finally:
            client.close()
    indexes = _index_names(plan["Plan"])
    assert "pk_jobs" in indexes and indexes <= {"pk_jobs", "pk_batches"}, indexes
    assert last_analyze is not None
