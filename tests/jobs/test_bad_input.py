"""Bad input is refused at enqueue with an error naming the field (nothing stored, nothing
published), or stored by a documented rule; never silently changed or dropped."""

import datetime
import math
import threading

import numpy as np
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from tests import support
from weir.jobs import batches, results
from weir.jobs.catalog import store as catalog_store
from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.db import Batch, Job, JobStatus, make_engine, make_session_factory
from weir.jobs.results import NUL_REPLACEMENT, JobResult
from weir.jobs.schemas import MAX_TEXT_CHARS, ClassifyRequest, GenerateRequest

JSON_VALUES = "not a JSON value (str, int, float, bool, None, list, dict)"


def num_published(celery_app, queue):
    """Messages waiting in ``queue`` and its interactive queue (where priority-0 jobs go)."""
    from weir.jobs import names

    with celery_app.connection_for_read() as connection:
        return sum(connection.default_channel.queue_declare(name, passive=False).message_count
                   for name in (queue, names.interactive_queue(queue)))


def counts(client):
    with client.session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job)), session.scalar(
            select(func.count()).select_from(Batch))


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"raw": b"\x00\x01"}, f"metadata['raw'] is a bytes, {JSON_VALUES}"),
        ({"when": datetime.datetime(2026, 1, 2)}, f"metadata['when'] is a datetime.datetime, {JSON_VALUES}"),
        ({"tags": {"a", "b"}}, f"metadata['tags'] is a set, {JSON_VALUES}"),
        ({"score": np.float32(0.5)}, f"metadata['score'] is a numpy.float32, {JSON_VALUES}"),
        ({"n": [1, {"deep": np.int64(3)}]}, f"metadata['n'][1]['deep'] is a numpy.int64, {JSON_VALUES}"),
        ({"x": math.nan}, "metadata['x'] is nan; JSON has no NaN or Infinity (use None)"),
        ({"x": -math.inf}, "metadata['x'] is -inf; JSON has no NaN or Infinity (use None)"),
        ({1: "a"}, "metadata has a key 1 of type int; JSON keys are strings"),
        ({"big": 2**64}, "metadata['big'] = 18446744073709551616 is outside the 64-bit integer range"),
    ],
)
def test_job_metadata_that_is_not_json_is_refused_naming_the_field(client, celery_app, queue, metadata, message):
    before = counts(client)
    with pytest.raises(ValidationError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok"), {"kind": "generate", "prompt": "p", "metadata": metadata}])
    [error] = info.value.errors()
    assert error["loc"] == ("metadata",)
    assert error["msg"] == f"Value error, {message}"
    assert counts(client) == before
    assert num_published(celery_app, queue) == 0


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"run": math.nan}, "batch metadata['run'] is nan; JSON has no NaN or Infinity (use None)"),
        ({"at": datetime.date(2026, 1, 2)}, f"batch metadata['at'] is a datetime.date, {JSON_VALUES}"),
    ],
)
def test_batch_metadata_that_is_not_json_is_refused_naming_the_field(client, celery_app, queue, metadata, message):
    before = counts(client)
    with pytest.raises(ValueError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok")], metadata=metadata)
    assert str(info.value) == message
    assert counts(client) == before
    assert num_published(celery_app, queue) == 0


def test_json_metadata_round_trips_exactly(client):
    metadata = {"f": 0.1, "i": -(2**63), "s": "é\u200f", "l": [None, True, {"k": []}]}
    batch_id = client.enqueue_batch([GenerateRequest(prompt="ok", metadata=metadata)], metadata=metadata)
    [row] = client.results(batch_id)
    assert row["metadata"] == metadata
    assert client.batch_status(batch_id).metadata == metadata


def test_a_5_mb_prompt_is_refused_at_enqueue_with_a_size_error(client, celery_app, queue):
    before = counts(client)
    huge = "a" * (5 * 1024 * 1024)
    with pytest.raises(ValidationError) as info:
        client.enqueue_batch([GenerateRequest(prompt="ok"), {"kind": "generate", "prompt": huge}])
    [error] = info.value.errors()
    assert (error["loc"], error["msg"]) == (("prompt", "text"), f"String should have at most {MAX_TEXT_CHARS} characters")
    with pytest.raises(ValidationError) as info:
        ClassifyRequest(prompt=[{"role": "user", "content": huge}], labels=["a"])
    assert [e["loc"] for e in info.value.errors()] == [("prompt", "messages", 0, "content")]
    assert counts(client) == before
    assert num_published(celery_app, queue) == 0


# ---- result storage rules, on Postgres and SQLite --------------------------------------------------





def claimed_jobs(session_factory, requests):
    with session_factory.begin() as session:
        _, jobs = support.create_batch(session, requests, model="tiny")
    claimed = []
    for job in jobs:
        with session_factory.begin() as session:
            claimed.append(support.claim_job(session, job.id))
    return claimed


def load_job(session_factory, job_id):
    with session_factory() as session:
        return session.get(Job, job_id)


def test_nul_characters_are_stored_as_replacement_characters_never_cut(session_factory):
    [job] = claimed_jobs(session_factory, [GenerateRequest(prompt="p", extensions={"enrichment": {"catalog": "c.csv",
                                                                                   "product_id": "nul-1"}})])
    text = "before\x00after\x00"
    with session_factory.begin() as session:
        assert support.record_result(session, job, JobResult(status=JobStatus.SUCCEEDED, output_text=text))
        catalog_store.record_enrichment(session, job, JobResult(status=JobStatus.SUCCEEDED, output_text=text), model="t")
    stored = load_job(session_factory, job.id).output_text
    assert stored == f"before{NUL_REPLACEMENT}after{NUL_REPLACEMENT}" and len(stored) == len(text)
    with session_factory() as session:
        assert session.get(ProductEnrichment, ("c.csv", "nul-1")).description == stored


def test_nan_and_infinity_in_result_json_are_stored_as_null(session_factory):
    labels = ["a", "b", "c"]
    [job] = claimed_jobs(session_factory, [ClassifyRequest(prompt="p", labels=labels,
                                                           extensions={"enrichment": {"catalog": "c.csv", "product_id": "nan-1"}})])
    result = JobResult(status=JobStatus.SUCCEEDED, label="a",
                       label_probs={"a": math.nan, "b": math.inf, "c": 0.25})
    with session_factory.begin() as session:
        assert support.record_result(session, job, result)
        catalog_store.record_enrichment(session, job, result, model="t")
    assert load_job(session_factory, job.id).label_probs == {"a": None, "b": None, "c": 0.25}
    with session_factory() as session:
        assert session.get(ProductEnrichment, ("c.csv", "nan-1")).category_confidence is None


def test_same_job_twice_in_one_batched_upsert_keeps_one_row_with_the_success(session_factory):
    jobs = claimed_jobs(session_factory, [GenerateRequest(prompt="p"), GenerateRequest(prompt="q")])
    ok_first = JobResult(status=JobStatus.SUCCEEDED, output_text="first")
    ok_second = JobResult(status=JobStatus.SUCCEEDED, output_text="second")
    with session_factory.begin() as session:
        written = results.record_results(session, [
            (jobs[0], ok_first), (jobs[0], JobResult.failure("late")), (jobs[1], ok_first), (jobs[1], ok_second),
        ])
    assert written == {jobs[0].id, jobs[1].id}
    with session_factory() as session:
        rows = session.execute(select(Job.id, Job.status, Job.output_text, Job.error)
                               .where(Job.id.in_([j.id for j in jobs]))).all()
        batch = batches.get_batch(session, jobs[0].batch_id)
    assert sorted(rows, key=lambda r: r.output_text) == [
        (jobs[0].id, JobStatus.SUCCEEDED, "first", None), (jobs[1].id, JobStatus.SUCCEEDED, "second", None)
    ]
    assert (batch.num_succeeded, batch.num_failed) == (2, 0)


def test_two_concurrent_writers_of_one_claim_store_one_outcome_counted_once(postgres_url):
    engine = make_engine(postgres_url)
    session_factory = make_session_factory(engine)
    try:
        for _ in range(5):
            [job] = claimed_jobs(session_factory, [GenerateRequest(prompt="p")])
            start = threading.Barrier(2)
            errors = []

            took = []

            def write(result):
                try:
                    start.wait()
                    with session_factory.begin() as session:
                        if support.record_result(session, job, result):
                            took.append(result.status)
                except Exception as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=write, args=(r,)) for r in (
                JobResult(status=JobStatus.SUCCEEDED, output_text="won"), JobResult.failure("lost"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            with session_factory() as session:
                rows = session.execute(select(Job.status, Job.output_text, Job.error).where(Job.id == job.id)).all()
                batch = batches.get_batch(session, job.batch_id)
            # The first to commit wins; a finished job is never changed again.
            [status] = took
            assert rows == [(JobStatus.SUCCEEDED, "won", None)] if status == JobStatus.SUCCEEDED else [
                (JobStatus.FAILED, None, "lost")]
            assert (batch.num_succeeded, batch.num_failed) == ((1, 0) if status == JobStatus.SUCCEEDED else (0, 1))
    finally:
        engine.dispose()


def test_unicode_round_trips_through_the_database(session_factory):
    text = "🍵 緑茶 — شاي أخضر \u200f עברית 👩🏽‍🔬"
    [job] = claimed_jobs(session_factory, [ClassifyRequest(prompt=text, labels=[text, "b"], custom_id=text,
                                                           metadata={text: text})])
    result = JobResult(status=JobStatus.SUCCEEDED, label=text, label_probs={text: 0.5, "b": 0.5})
    with session_factory.begin() as session:
        support.record_result(session, job, result)
    stored = load_job(session_factory, job.id)
    assert stored.label.encode("utf-8") == text.encode("utf-8")
    assert stored.custom_id == text and stored.request["prompt"] == text
    assert stored.request["metadata"] == {text: text} and stored.label_probs == {text: 0.5, "b": 0.5}


def test_what_is_published_is_counted(client, celery_app, queue):
    client.enqueue_batch([GenerateRequest(prompt="a"), GenerateRequest(prompt="b")])
    assert num_published(celery_app, queue) == 2
