"""Result writes: idempotent upserts keyed by job id, guarded against late failures, with batch
counts that stay exact. Runs on a fresh Postgres database and on SQLite."""

import json
import threading
import uuid

import pytest
from sqlalchemy import func, select

from tests import support
from weir.jobs.batches import (
    begin_batch, cancel_batch, cancel_job, delete_stale_validating, get_batch, list_jobs,
)
from weir.jobs.catalog import store as catalog_store
from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.claims import Claim, ClaimStatus, claim_jobs, job_status, release_jobs, renew_leases
from weir.jobs.counters import reconcile_batches
from weir.jobs.db import BatchStatus, Job, JobStatus
from weir.jobs.outbox import mark_published, take_jobs_to_publish
from weir.jobs.results import JobResult, parse_json_output, record_dead_letter, record_results
from weir.jobs.schemas import ClassifyRequest, GenerateRequest





CATALOG = "/data/catalog.csv"


def enriching(product_id, catalog=CATALOG):
    return {"catalog": catalog, "product_id": product_id}


def make_batch(session_factory, num_jobs=3):
    requests = [
        GenerateRequest(prompt=f"p{i}", custom_id=f"c{i}", extensions={"enrichment": enriching(f"prod-{i}")})
        for i in range(num_jobs)
    ]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny", metadata={"x": 1})
    return batch.id, [job.id for job in jobs]


def run(session_factory, job_id, result):
    """What the task does: claim, then record (None when nothing was claimed)."""
    with session_factory.begin() as session:
        job = support.claim_job(session, job_id)
    if job is None:
        return None
    with session_factory.begin() as session:
        written = support.record_result(session, job, result)
        if written:
            catalog_store.record_enrichment(session, job, result, model="tiny")
    return written


def ok(text="out"):
    return JobResult(status=JobStatus.SUCCEEDED, output_text=text, finish_reason="stop",
                     num_prompt_tokens=5, num_completion_tokens=2, num_cached_tokens=0)


def load(session_factory, batch_id):
    with session_factory() as session:
        return get_batch(session, batch_id), list_jobs(session, batch_id)


def test_create_batch_stores_queued_jobs_in_order(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    batch, jobs = load(session_factory, batch_id)
    assert batch.status == BatchStatus.QUEUED and batch.num_jobs == 3 and batch.meta == {"x": 1}
    assert [j.id for j in jobs] == job_ids
    assert [(j.batch_index, j.custom_id, j.status, j.attempts) for j in jobs] == [
        (0, "c0", JobStatus.QUEUED, 0), (1, "c1", JobStatus.QUEUED, 0), (2, "c2", JobStatus.QUEUED, 0)
    ]
    assert jobs[0].request["prompt"] == "p0" and jobs[0].request["kind"] == "generate"


def test_default_custom_ids_are_positions(session_factory):
    with session_factory.begin() as session:
        _, jobs = support.create_batch(session, [GenerateRequest(prompt="a"), GenerateRequest(prompt="b")],
                                       model="tiny")
    assert [j.custom_id for j in jobs] == ["0", "1"]


def test_duplicate_custom_id_stores_nothing(session_factory):
    with pytest.raises(ValueError, match="'dup' appears more than once"):
        with session_factory.begin() as session:
            support.create_batch(
                session,
                [GenerateRequest(prompt="a", custom_id="dup"), GenerateRequest(prompt="b", custom_id="dup")],
                model="tiny",
            )
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.custom_id == "dup")) == 0


def test_claim_marks_running_and_counts_attempts(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0], lease_s=0)
    assert job.status == JobStatus.RUNNING and job.attempts == 1 and job.started_at is not None
    with session_factory.begin() as session:  # its lease has expired: a redelivery claims it again
        assert support.claim_job(session, job_ids[0]).attempts == 2
    batch, _ = load(session_factory, batch_id)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.started_at is not None


def test_a_live_lease_is_not_claimed_twice(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    with session_factory.begin() as session:
        claims = claim_jobs(session, job_ids[:2], worker="w1", lease_s=60)
    assert [claims[i].status for i in job_ids[:2]] == [ClaimStatus.CLAIMED] * 2
    with session_factory.begin() as session:  # a duplicate delivery while w1 runs them
        again = claim_jobs(session, job_ids, worker="w2", lease_s=60)
    assert [again[i].status for i in job_ids] == [ClaimStatus.HELD, ClaimStatus.HELD,
                                                  ClaimStatus.CLAIMED]
    held, own = again[job_ids[0]].lease_expires_at, claims[job_ids[0]].lease_expires_at
    assert held.replace(tzinfo=None) == own.replace(tzinfo=None)  # SQLite keeps no zone
    _, jobs = load(session_factory, batch_id)
    assert [(j.attempts, j.worker) for j in jobs] == [(1, "w1"), (1, "w1"), (1, "w2")]


def test_a_stale_attempt_changes_nothing(session_factory):
    batch_id, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        stale = support.claim_job(session, job_ids[0], worker="dead", lease_s=0)
    with session_factory.begin() as session:  # the lease expired; another worker takes the job
        fresh = support.claim_job(session, job_ids[0], worker="alive", lease_s=60)
    assert (stale.attempts, fresh.attempts, stale.lease_token, fresh.lease_token) == (1, 2, 1, 2)
    with session_factory.begin() as session:
        assert renew_leases(session, [(job_ids[0], stale.lease_token)], worker="dead", lease_s=60) == set()
        assert support.record_result(session, stale, ok("stale")) is False
        assert catalog_store.record_enrichment(session, stale, ok("stale"), model="tiny") is True  # unguarded alone
        session.rollback()
    batch, jobs = load(session_factory, batch_id)
    assert (jobs[0].status, jobs[0].output_text, batch.num_succeeded) == (JobStatus.RUNNING, None, 0)
    with session_factory.begin() as session:
        assert renew_leases(session, [(job_ids[0], fresh.lease_token)], worker="alive", lease_s=60) == {job_ids[0]}
        assert support.record_result(session, fresh, ok("fresh")) is True
        assert support.record_result(session, stale, ok("stale")) is False
    batch, jobs = load(session_factory, batch_id)
    assert (jobs[0].status, jobs[0].output_text, jobs[0].attempts) == (JobStatus.SUCCEEDED, "fresh", 2)
    assert (batch.status, batch.num_succeeded, batch.num_failed) == (BatchStatus.COMPLETED, 1, 0)


def test_a_renewal_moves_the_lease_to_lease_s_from_now(session_factory):
    from datetime import timedelta

    from weir.jobs.db import utcnow

    _, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0], worker="w", lease_s=1)
    before = utcnow()
    with session_factory.begin() as session:
        assert renew_leases(session, [(job.id, job.lease_token)], worker="w", lease_s=120) == {job.id}
    with session_factory() as session:
        expires = session.get(Job, job.id).lease_expires_at
    expires = expires.replace(tzinfo=before.tzinfo) if expires.tzinfo is None else expires
    assert before + timedelta(seconds=119) < expires < utcnow() + timedelta(seconds=121)


def test_a_released_job_is_claimed_at_once(session_factory):
    _, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0], worker="w1", lease_s=60)
    from datetime import timedelta

    from weir.jobs.db import utcnow

    def published_at():
        with session_factory() as session:
            stamp = session.get(Job, job_ids[0]).published_at
        return stamp.replace(tzinfo=None) if stamp is not None else None

    before = utcnow().replace(tzinfo=None)
    with session_factory.begin() as session:
        assert release_jobs(session, [(job.id, job.lease_token)]) == {job.id}
        assert release_jobs(session, [(job.id, job.lease_token)]) == set()  # no longer held
    # stamped published now: its message goes back to the queue, so the sweeper leaves it alone
    assert before <= published_at() <= utcnow().replace(tzinfo=None)
    with session_factory.begin() as session:
        again = support.claim_job(session, job_ids[0], worker="w2", lease_s=60)
    assert (again.attempts, again.lease_token) == (2, 2)
    later = before + timedelta(seconds=30)  # a retry's message, published with a countdown
    with session_factory.begin() as session:
        assert release_jobs(session, [(again.id, again.lease_token)], republish_at=later) == {again.id}
    assert published_at() == later
    with session_factory.begin() as session:
        again = support.claim_job(session, job_ids[0], worker="w2", lease_s=60)
    assert (again.attempts, again.lease_token) == (3, 3)
    with session_factory.begin() as session:  # an engine failure: the start is given back
        assert release_jobs(session, [(again.id, again.lease_token)], refund_attempt=True) == {again.id}
    with session_factory.begin() as session:
        third = support.claim_job(session, job_ids[0], worker="w3", lease_s=60)
    assert (third.attempts, third.lease_token) == (3, 4)


def test_reconcile_repairs_counters_changed_by_hand(session_factory):
    from sqlalchemy import update

    from weir.jobs.db import Batch

    batch_id, job_ids = make_batch(session_factory)
    for job_id in job_ids:
        run(session_factory, job_id, ok())
    with session_factory.begin() as session:
        assert reconcile_batches(session, [batch_id]) == []
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            num_succeeded=1, status=BatchStatus.IN_PROGRESS, finished_at=None))
    with session_factory.begin() as session:
        [repaired] = reconcile_batches(session, [batch_id])
    assert (repaired.before, repaired.after) == ((1, 0, 0, "in_progress"), (3, 0, 0, "completed"))
    batch, _ = load(session_factory, batch_id)
    assert (batch.status, batch.num_succeeded) == (BatchStatus.COMPLETED, 3)


def test_an_older_batch_never_overwrites_a_newer_enrichment(session_factory):
    product = f"prod-{uuid.uuid4().hex[:8]}"
    claimed = []
    for text in ("old", "new"):
        with session_factory.begin() as session:
            _, [job] = support.create_batch(
                session, [GenerateRequest(prompt="p", extensions={"enrichment": enriching(product)})], model="tiny")
        with session_factory.begin() as session:
            claimed.append((support.claim_job(session, job.id), text))
    for job, text in reversed(claimed):  # the newer batch's result lands first
        with session_factory.begin() as session:
            assert support.record_result(session, job, ok(text)) is True
            written = catalog_store.record_enrichments(session, [(job, ok(text))], model="tiny")
        assert written == ({(CATALOG, product)} if text == "new" else set())
    with session_factory() as session:
        row = session.get(ProductEnrichment, (CATALOG, product))
    assert (row.description, row.source_batch_id) == ("new", claimed[1][0].batch_id)


def test_claim_of_unknown_job_is_none(session_factory):
    with session_factory.begin() as session:
        assert support.claim_job(session, uuid.uuid4()) is None


def test_same_job_recorded_twice_leaves_one_row(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0])
    for _ in range(2):
        with session_factory.begin() as session:
            support.record_result(session, job, ok("first"))
    with session_factory() as session:
        rows = session.scalars(select(Job).where(Job.id == job_ids[0])).all()
    assert len(rows) == 1
    assert (rows[0].status, rows[0].output_text, rows[0].num_completion_tokens) == (
        JobStatus.SUCCEEDED, "first", 2)
    batch, _ = load(session_factory, batch_id)
    assert (batch.num_succeeded, batch.num_failed) == (1, 0)


@pytest.mark.parametrize("first, second, stored", [
    ("succeeded", "failed", ("succeeded", "first")),  # a success is kept over a failure, in either order
    ("failed", "succeeded", ("succeeded", "second")),
    ("failed", "failed", ("failed", "second")),  # else the later outcome
])
def test_one_job_twice_in_one_group_keeps_a_success_else_the_later_outcome(session_factory, first, second, stored):
    batch_id, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0])
    outcome = {"succeeded": ok, "failed": JobResult.failure}
    with session_factory.begin() as session:
        written = record_results(session, [(job, outcome[first]("first")), (job, outcome[second]("second"))])
    assert written == {job.id}
    batch, [row] = load(session_factory, batch_id)
    assert (row.status.value, row.output_text if row.status == JobStatus.SUCCEEDED else row.error) == stored
    assert (batch.num_succeeded, batch.num_failed) == ((1, 0) if stored[0] == "succeeded" else (0, 1))


def test_redelivered_succeeded_job_is_not_run_again(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    assert run(session_factory, job_ids[0], ok("first")) is True
    assert run(session_factory, job_ids[0], ok("second")) is None
    _, jobs = load(session_factory, batch_id)
    assert (jobs[0].output_text, jobs[0].attempts) == ("first", 1)


def test_late_failure_never_overwrites_success(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0])
    with session_factory.begin() as session:
        assert support.record_result(session, job, ok("kept")) is True
    with session_factory.begin() as session:
        assert support.record_result(session, job, JobResult.failure("late: worker lost")) is False
    _, jobs = load(session_factory, batch_id)
    assert (jobs[0].status, jobs[0].output_text, jobs[0].error) == (JobStatus.SUCCEEDED, "kept", None)
    batch, _ = load(session_factory, batch_id)
    assert (batch.num_succeeded, batch.num_failed) == (1, 0)


def test_a_finished_failure_is_final(session_factory):
    batch_id, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0])
    with session_factory.begin() as session:
        support.record_result(session, job, JobResult.failure("ValueError: boom"))
    batch, _ = load(session_factory, batch_id)
    assert (batch.status, batch.num_failed) == (BatchStatus.FAILED, 1)
    with session_factory.begin() as session:  # a late success of the same attempt
        assert support.record_result(session, job, ok()) is False
    batch, jobs = load(session_factory, batch_id)
    assert (jobs[0].status, jobs[0].error) == (JobStatus.FAILED, "ValueError: boom")
    assert (batch.status, batch.num_succeeded, batch.num_failed) == (BatchStatus.FAILED, 0, 1)


def test_batch_lifecycle_and_counts(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    run(session_factory, job_ids[0], ok())
    batch, _ = load(session_factory, batch_id)
    assert (batch.status, batch.num_succeeded, batch.finished_at) == (BatchStatus.IN_PROGRESS, 1, None)
    run(session_factory, job_ids[1], JobResult.failure("ValueError: prompt is empty"))
    run(session_factory, job_ids[2], ok())
    batch, jobs = load(session_factory, batch_id)
    assert (batch.status, batch.num_succeeded, batch.num_failed) == (BatchStatus.COMPLETED, 2, 1)
    assert batch.finished_at is not None
    assert jobs[1].error == "ValueError: prompt is empty" and jobs[1].output_text is None


def test_record_rejects_non_final_status(session_factory):
    _, job_ids = make_batch(session_factory, num_jobs=1)
    with session_factory.begin() as session:
        job = support.claim_job(session, job_ids[0])
        with pytest.raises(ValueError, match="not running"):
            support.record_result(session, job, JobResult(status=JobStatus.RUNNING))


def test_cancel_skips_queued_jobs(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    run(session_factory, job_ids[0], ok())
    with session_factory.begin() as session:
        cancel_batch(session, batch_id)
    assert run(session_factory, job_ids[1], ok()) is None
    batch, jobs = load(session_factory, batch_id)
    assert batch.status == BatchStatus.CANCELLED
    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.CANCELLED]
    assert (batch.num_succeeded, batch.num_cancelled) == (1, 2)


def test_enrichment_rows_merge_category_and_description(session_factory):
    requests = [
        ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id="7/category",
                        extensions={"enrichment": enriching("7")}),
        GenerateRequest(prompt="p", custom_id="7/description", extensions={"enrichment": enriching("7")}),
        GenerateRequest(prompt="p", custom_id="plain"),
    ]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny")
    run(session_factory, jobs[0].id, JobResult(status=JobStatus.SUCCEEDED, label="Soap",
                                               label_probs={"Tea": 0.25, "Soap": 0.75}))
    run(session_factory, jobs[1].id, ok("A fine soap."))
    run(session_factory, jobs[2].id, ok())
    with session_factory() as session:
        rows = session.scalars(select(ProductEnrichment).where(ProductEnrichment.source_batch_id == batch.id)).all()
    assert [(r.catalog, r.product_id, r.category, r.category_confidence, r.description, r.quality, r.model)
            for r in rows] == [(CATALOG, "7", "Soap", 0.75, "A fine soap.", "ok", "tiny")]


ATTRIBUTES_SCHEMA = {"type": "object", "properties": {"brand": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                                     "pack_of": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}


def test_an_attribute_extraction_fills_attributes_and_leaves_the_description(session_factory):
    extract = dict(structured_outputs={"json": ATTRIBUTES_SCHEMA})
    requests = [
        GenerateRequest(prompt="p", custom_id="17/description", extensions={"enrichment": enriching("17")}),
        GenerateRequest(prompt="p", custom_id="17/attributes", extensions={"enrichment": {**enriching("17"), "field": "attributes"}},
                        **extract),
        GenerateRequest(prompt="p", custom_id="18/attributes", extensions={"enrichment": {**enriching("18"), "field": "attributes"}},
                        **extract),
    ]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny")
    run(session_factory, jobs[0].id, ok("A fine soap! "))  # the kept stop string "! " ends in a space
    value = {"brand": "Dove \u00e9", "pack_of": None}
    run(session_factory, jobs[1].id, JobResult(status=JobStatus.SUCCEEDED, output_text=json.dumps(value),
                                               finish_reason="stop", parsed=value))
    # cut by max_tokens: nothing parsed, the row's attributes stay null
    run(session_factory, jobs[2].id, JobResult(status=JobStatus.SUCCEEDED, output_text='{"brand": "Do',
                                               finish_reason="length", parsed=None))
    with session_factory() as session:
        rows = session.scalars(select(ProductEnrichment).where(ProductEnrichment.source_batch_id == batch.id)
                               .order_by(ProductEnrichment.product_id)).all()
    assert [(r.product_id, r.description, r.quality, r.attributes, r.category) for r in rows] == [
        ("17", "A fine soap!", "ok", {"brand": "Dove \u00e9", "pack_of": None}, None),
        ("18", None, None, None, None)]


def num_enrichment_rows(session_factory, batch_id):
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(ProductEnrichment)
                              .where(ProductEnrichment.source_batch_id == batch_id))


def test_a_job_whose_metadata_names_a_product_writes_no_enrichment(session_factory):
    # A sentiment job about a product: its label is no category of any catalog.
    request = ClassifyRequest(prompt="Great tea!", labels=["positive", "negative"],
                              metadata={"product_id": "tea-1"})
    with session_factory.begin() as session:
        batch, [job] = support.create_batch(session, [request], model="tiny")
    with session_factory.begin() as session:
        job = support.claim_job(session, job.id)
    result = JobResult(status=JobStatus.SUCCEEDED, label="positive", label_probs={"positive": 0.9, "negative": 0.1})
    with session_factory.begin() as session:
        assert support.record_result(session, job, result) is True
        assert catalog_store.record_enrichments(session, [(job, result)], model="tiny") == set()
    assert num_enrichment_rows(session_factory, batch.id) == 0


def test_two_catalogs_with_the_same_product_id_keep_both_rows(session_factory):
    requests = [ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id=f"{catalog}/1/category",
                                extensions={"enrichment": enriching("1", catalog)})
                for catalog in ("/data/shop-a.csv", "/data/shop-b.csv")]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny")
    for job, label in zip(jobs, ("Tea", "Soap")):
        run(session_factory, job.id, JobResult(status=JobStatus.SUCCEEDED, label=label,
                                               label_probs={"Tea": 0.5, "Soap": 0.5}))
    with session_factory() as session:
        rows = session.execute(select(ProductEnrichment.catalog, ProductEnrichment.product_id,
                                      ProductEnrichment.category)
                               .where(ProductEnrichment.source_batch_id == batch.id)
                               .order_by(ProductEnrichment.catalog)).all()
    assert [tuple(r) for r in rows] == [("/data/shop-a.csv", "1", "Tea"), ("/data/shop-b.csv", "1", "Soap")]


def test_every_completion_and_the_parsed_value_are_stored_as_given(session_factory):
    completions = [
        {"index": 0, "text": '"tea"', "finish_reason": "stop", "stop_reason": None, "num_tokens": 3,
         "cumulative_logprob": -1.5, "parsed": "tea",
         "logprobs": [[{"token_id": 5, "logprob": -0.5, "rank": 1, "decoded_token": '"'}]]},
        {"index": 1, "text": "x\x00", "finish_reason": "length", "stop_reason": None, "num_tokens": 2,
         "cumulative_logprob": float("-inf"), "parsed": None, "logprobs": None},
    ]
    prompt_logprobs = [None, [{"token_id": 9, "logprob": -2.0, "rank": 3, "decoded_token": "a"}]]
    batch_id, job_ids = make_batch(session_factory, num_jobs=3)
    results = [
        JobResult(status=JobStatus.SUCCEEDED, output_text='"tea"', finish_reason="stop", completions=completions,
                  parsed="tea", prompt_logprobs=prompt_logprobs, num_completion_tokens=5),
        JobResult(status=JobStatus.SUCCEEDED, output_text="{}", finish_reason="stop", parsed={"a": [1, None]}),
        ok(),
    ]
    for job_id, result in zip(job_ids, results):
        run(session_factory, job_id, result)
    _, jobs = load(session_factory, batch_id)
    stored = [dict(completions[0]), dict(completions[1], text="x\ufffd", cumulative_logprob=None)]
    assert (jobs[0].completions, jobs[0].parsed, jobs[0].prompt_logprobs) == (stored, "tea", prompt_logprobs)
    assert (jobs[1].completions, jobs[1].parsed) == (None, {"a": [1, None]})
    with session_factory() as session:  # SQL NULL, not JSON null, where nothing was parsed
        nulls = session.execute(select(Job.id).where(Job.batch_id == batch_id, Job.parsed.is_(None))).scalars().all()
    assert nulls == [job_ids[2]]


@pytest.mark.parametrize("text, finish_reason, parsed", [
    ('{"a": 1}', "stop", {"a": 1}),
    (' [1, "x"] ', "stop", [1, "x"]),
    ('{"a": 1}', "length", None),
    ('{"a": 1', "stop", None),
    ('{"a": NaN}', "stop", None),
    ("", "stop", None),
])
def test_parse_json_output(text, finish_reason, parsed):
    assert parse_json_output(text, finish_reason) == parsed


def test_enrichment_row_flags_an_unfinished_looping_description(session_factory):
    request = GenerateRequest(prompt="p", custom_id="8/description", extensions={"enrichment": enriching("8")})
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, [request], model="tiny")
    run(session_factory, jobs[0].id, ok("Fast 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs"))
    with session_factory() as session:
        row = session.get(ProductEnrichment, (CATALOG, "8"))
    assert (row.description, row.quality) == ("Fast 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs",
                                              "unfinished,repetitive")


def test_concurrent_results_keep_exact_counts(session_factory):
    num_jobs = 24
    batch_id, job_ids = make_batch(session_factory, num_jobs=num_jobs)
    errors = []

    def finish(ids):
        try:
            for i in ids:
                run(session_factory, i, ok() if i.int % 3 else JobResult.failure("x"))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=(job_ids[k::6],)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    batch, jobs = load(session_factory, batch_id)
    num_failed = sum(1 for i in job_ids if i.int % 3 == 0)
    assert (batch.num_succeeded, batch.num_failed) == (num_jobs - num_failed, num_failed)
    assert batch.status == (BatchStatus.FAILED if num_failed == num_jobs else BatchStatus.COMPLETED)
    assert all(j.attempts == 1 for j in jobs)


def test_claim_records_the_worker_and_fails_a_job_out_of_attempts(session_factory):
    batch_id, job_ids = make_batch(session_factory, num_jobs=2)
    for attempt in (1, 2):
        with session_factory.begin() as session:
            job = support.claim_job(session, job_ids[0], worker=f"w{attempt}", max_attempts=2, lease_s=0)
        assert (job.attempts, job.worker, job.status) == (attempt, f"w{attempt}", JobStatus.RUNNING)
    with session_factory.begin() as session:  # a third delivery: both attempts lost their worker
        assert claim_jobs(session, [job_ids[0]], worker="w3", max_attempts=2, lease_s=60) == {
            job_ids[0]: Claim(ClaimStatus.GAVE_UP)}
    batch, jobs = load(session_factory, batch_id)
    assert (jobs[0].status, jobs[0].attempts, jobs[0].worker) == (JobStatus.FAILED, 2, "w2")
    assert jobs[0].error == "gave up after 2 attempts: each one lost its worker or ran out of time"
    assert (batch.num_failed, batch.num_succeeded, batch.status) == (1, 0, BatchStatus.IN_PROGRESS)


def test_cancel_batch_cancels_running_jobs_and_drops_their_late_result(session_factory):
    batch_id, job_ids = make_batch(session_factory)
    run(session_factory, job_ids[0], ok())
    with session_factory.begin() as session:
        running = support.claim_job(session, job_ids[1])
    with session_factory.begin() as session:
        cancel_batch(session, batch_id)
    with session_factory() as session:
        assert job_status(session, job_ids[1]) == JobStatus.CANCELLED
    with session_factory.begin() as session:
        assert support.record_result(session, running, ok("late")) is False
    batch, jobs = load(session_factory, batch_id)
    assert [(j.status, j.output_text) for j in jobs] == [
        (JobStatus.SUCCEEDED, "out"), (JobStatus.CANCELLED, None), (JobStatus.CANCELLED, None)]
    assert (batch.status, batch.num_succeeded, batch.num_cancelled) == (BatchStatus.CANCELLED, 1, 2)


def test_cancel_one_job(session_factory):
    batch_id, job_ids = make_batch(session_factory, num_jobs=2)
    with session_factory.begin() as session:
        assert cancel_job(session, job_ids[0]).status == JobStatus.CANCELLED
    assert run(session_factory, job_ids[0], ok()) is None
    run(session_factory, job_ids[1], ok())
    batch, _ = load(session_factory, batch_id)
    assert (batch.status, batch.num_cancelled, batch.num_succeeded) == (BatchStatus.COMPLETED, 1, 1)
    with session_factory.begin() as session, pytest.raises(LookupError):
        cancel_job(session, uuid.uuid4())


def test_sweeper_takes_lost_jobs_once(session_factory):
    from datetime import timedelta

    from weir.jobs.db import utcnow

    model = f"sweep-{uuid.uuid4().hex[:8]}"  # the database is shared with other tests
    with session_factory.begin() as session:
        _, jobs = support.create_batch(session, [GenerateRequest(prompt=f"p{i}") for i in range(5)], model=model)
    job_ids = [job.id for job in jobs]
    with session_factory.begin() as session:
        support.claim_job(session, job_ids[1], lease_s=60)  # running under a live lease: its worker is alive
        support.claim_job(session, job_ids[2], lease_s=0)  # running under an expired lease: its worker died
    run(session_factory, job_ids[3], ok())
    with session_factory.begin() as session:
        mark_published(session, [job_ids[0]], None)  # its publish failed
    now = utcnow() + timedelta(milliseconds=10)
    with session_factory.begin() as session:  # a backlog: no queued job is taken by its age
        assert sorted(take_jobs_to_publish(session, model=model, older_than=now)) == sorted(
            [job_ids[0], job_ids[2]])
    with session_factory.begin() as session:  # a second sweep right after finds nothing
        assert take_jobs_to_publish(session, model=model, older_than=now) == []
    later = utcnow() + timedelta(seconds=1)  # the queue moved past every message published so far
    with session_factory.begin() as session:
        taken = take_jobs_to_publish(session, model=model, older_than=now, queued_before=later)
        assert take_jobs_to_publish(session, model="other", older_than=later, queued_before=later) == []
    assert sorted(taken) == sorted([job_ids[0], job_ids[4]])  # queued ones; job 2 was published since


def test_the_sweepers_queue_position_takes_only_its_own_batchs_earlier_jobs_at_a_shared_publish_time(
        session_factory):
    """Two batches published under the same time: the horizon (batch A, index 2) takes A's jobs 0
    and 1 and nothing of batch B, whose messages may still wait behind it."""
    from datetime import timedelta

    from weir.jobs.db import utcnow

    model = f"sweep-{uuid.uuid4().hex[:8]}"
    with session_factory.begin() as session:
        a, a_jobs = support.create_batch(session, [GenerateRequest(prompt=f"a{i}") for i in range(4)], model=model)
        b, b_jobs = support.create_batch(session, [GenerateRequest(prompt=f"b{i}") for i in range(4)], model=model)
    published = utcnow() - timedelta(seconds=5)
    with session_factory.begin() as session:
        mark_published(session, [j.id for j in a_jobs + b_jobs], published)
    with session_factory.begin() as session:
        taken = take_jobs_to_publish(session, model=model, older_than=published - timedelta(seconds=1),
                                     queued_before=published, queued_before_job=(a.id, 2))
    assert taken == [a_jobs[0].id, a_jobs[1].id]


def test_the_sweepers_expired_lease_bounds_are_strict(session_factory):
    """A running job is taken once its lease expired strictly before ``older_than`` and it was
    last published strictly before that expiry (a publish at the expiry instant counts as since)."""
    from datetime import timedelta

    from sqlalchemy import update

    from weir.jobs.db import utcnow

    model = f"sweep-{uuid.uuid4().hex[:8]}"
    with session_factory.begin() as session:
        _, [job] = support.create_batch(session, [GenerateRequest(prompt="p")], model=model)
    with session_factory.begin() as session:
        support.claim_job(session, job.id, lease_s=60)
    expiry = utcnow().replace(microsecond=0) - timedelta(seconds=10)
    tick = timedelta(microseconds=1)

    def taken(published_at, older_than):
        with session_factory.begin() as session:
            session.execute(update(Job).where(Job.id == job.id).values(lease_expires_at=expiry,
                                                                          published_at=published_at))
        with session_factory() as session:  # rolled back: each probe starts from the same row
            return take_jobs_to_publish(session, model=model, older_than=older_than) == [job.id]

    assert not taken(expiry - tick, older_than=expiry)  # expired at, not before, older_than
    assert taken(expiry - tick, older_than=expiry + tick)
    assert not taken(expiry, older_than=expiry + tick)  # published at the expiry instant: since
    assert taken(expiry - tick, older_than=expiry + tick)


def test_dead_letters_keep_body_and_reason(session_factory):
    from weir.jobs.db import DeadLetter

    with session_factory.begin() as session:
        record_dead_letter(session, body=b"{not json\x00", reason="cannot decode", queue="q", task=None)
        record_dead_letter(session, body={"args": [1]}, reason="bad args", task="weir.run_job",
                           message_id="m-1")
    with session_factory() as session:
        rows = session.execute(select(DeadLetter.body, DeadLetter.reason, DeadLetter.queue, DeadLetter.task,
                                      DeadLetter.message_id).order_by(DeadLetter.received_at)).all()
    assert rows[-2:] == [("{not json\ufffd", "cannot decode", "q", None, None),
                         ("{'args': [1]}", "bad args", None, "weir.run_job", "m-1")]


def test_a_batch_left_validating_by_a_dead_producer_is_deleted_and_frees_its_key(session_factory):
    from datetime import timedelta

    from sqlalchemy import update

    from weir.jobs.db import Batch, utcnow

    key = f"catalog:/c.csv@{uuid.uuid4().hex}"
    with session_factory.begin() as session:
        stale = begin_batch(session, model="tiny", idempotency_key=key)
        fresh = begin_batch(session, model="tiny")
        session.execute(update(Batch).where(Batch.id == stale.id).values(created_at=utcnow() - timedelta(hours=2)))
    batch_id, _ = make_batch(session_factory)  # queued: never touched
    with session_factory.begin() as session:
        assert delete_stale_validating(session, created_before=utcnow() - timedelta(hours=1)) == [stale.id]
    with session_factory() as session:
        assert session.get(Batch, stale.id) is None
        assert session.get(Batch, fresh.id) is not None and session.get(Batch, batch_id) is not None
    with session_factory.begin() as session:  # the key is free again
        assert begin_batch(session, model="tiny", idempotency_key=key).idempotency_key == key
