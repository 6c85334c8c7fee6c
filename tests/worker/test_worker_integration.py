"""A real ``weir worker`` process against real Redis and Postgres, with a tiny random-weight model."""

import time

import pytest

from tests.worker.test_faults import wait_until
from sqlalchemy import func, select, text

from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.db import BatchStatus, Job, JobStatus
from weir.jobs.model_info import PromptChecker, load_tokenizer
from weir.jobs.schemas import ClassifyRequest, GenerateRequest

pytestmark = pytest.mark.integration


def test_failed_job_is_recorded_and_the_worker_goes_on(start_worker, client, worker_env):
    worker = start_worker()
    # This producer believes the model takes 100k tokens, so the worker's engine is the one to refuse.
    client.prompt_checker = PromptChecker(load_tokenizer(worker_env["WEIR_MODEL"]), 100_000)
    requests = [GenerateRequest(prompt=f"Item {i}", custom_id=f"gen-{i}", temperature=0, max_tokens=4)
                for i in range(4)]
    requests.append(GenerateRequest(prompt="word " * 600, custom_id="too-long", max_tokens=4))
    requests.append(ClassifyRequest(prompt="Product: Tea", system_prompt="Pick one.", labels=["Tea", "Soap"],
                                    custom_id="cls", extensions={"enrichment": {"catalog": "integration", "product_id": "p-1"}}))
    batch_id = client.enqueue_batch(requests)

    final = client.wait(batch_id, timeout_s=120)

    results = {r["custom_id"]: r for r in client.results(batch_id)}
    assert (final.status, final.num_succeeded, final.num_failed) == (BatchStatus.COMPLETED, 5, 1)
    failed = results["too-long"]
    assert failed["status"] == "failed" and failed["output_text"] is None
    assert failed["error"].startswith("ValueError: prompt has") and "max_model_len=512" in failed["error"]
    for i in range(4):
        row = results[f"gen-{i}"]
        assert row["status"] == "succeeded" and row["attempts"] == 1
        assert 1 <= row["num_completion_tokens"] <= 4 and row["finish_reason"] in ("stop", "length")
    cls = results["cls"]
    assert cls["label"] in ("Tea", "Soap") and sum(cls["label_probs"].values()) == pytest.approx(1.0)
    with client.session_factory() as session:
        enrichment = session.get(ProductEnrichment, ("integration", "p-1"))
    assert (enrichment.category, enrichment.source_batch_id) == (cls["label"], batch_id)
    assert enrichment.category_confidence == pytest.approx(cls["label_probs"][cls["label"]])

    assert worker.is_alive()
    again = client.enqueue_generate("Still there?", max_tokens=2)
    assert client.wait(again.batch_id, timeout_s=60).status == BatchStatus.COMPLETED
    assert worker.terminate() == 0


def test_sigterm_mid_batch_then_restart_runs_every_job_once(start_worker, client, hooked, effects):
    """Warm shutdown within the grace period (the default 60 s; past it:
    ``test_faults.py::test_sigterm_puts_jobs_past_the_grace_period_back_and_restart_finishes_them``):
    the running jobs finish and are stored, the rest stay queued; after a restart every job has
    run in the engine once and been stored once."""
    env, runs = hooked
    num_jobs = 40
    worker = start_worker(**env, WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2")
    batch_id = client.enqueue_batch(
        [GenerateRequest(prompt=f"Product number {i}", temperature=0, max_tokens=48) for i in range(num_jobs)]
    )
    while client.batch_status(batch_id).num_succeeded < 4:
        assert worker.is_alive()
        time.sleep(0.05)
    assert worker.terminate() == 0

    stopped = client.batch_status(batch_id)
    statuses = [r["status"] for r in client.results(batch_id)]
    assert 4 <= stopped.num_succeeded < num_jobs, "the batch must be cut in the middle"
    # Warm shutdown: tasks that had started finished; the rest were never claimed.
    assert set(statuses) == {"succeeded", "queued"}

    start_worker(**env)
    final = client.wait(batch_id, timeout_s=180)

    assert (final.status, final.num_succeeded, final.num_failed) == (BatchStatus.COMPLETED, num_jobs, 0)
    ids = [str(job.id) for job in client.jobs(batch_id)]
    counted = runs()
    assert {i: counted[i] for i in ids if counted[i] != 1} == {}  # engine runs, not rows
    assert set(effects("jobs", ids).values()) == {1}  # result writes
    with client.session_factory() as session:
        rows = session.execute(
            select(Job.custom_id, func.count(), func.max(Job.attempts))
            .where(Job.batch_id == batch_id, Job.status == JobStatus.SUCCEEDED)
            .group_by(Job.custom_id)
        ).all()
    assert sorted(custom_id for custom_id, _, _ in rows) == sorted(str(i) for i in range(num_jobs))
    assert all(count == 1 for _, count, _ in rows)
    assert all(attempts == 1 for _, _, attempts in rows)


def test_nightly_enrichment_task_enqueues_a_catalog_batch(start_worker, client, tmp_path):
    from weir.jobs import names
    from weir.jobs.db import Batch

    catalog = tmp_path / "catalog.csv"
    catalog.write_text(
        "index,product,category,brand,description\r\n"
        "1,Green Tea,Beverages,Leafy,A tea.\r\n"
        "2,Soap Bar,Beauty & Hygiene,Clean,\r\n",
        encoding="utf-8",
    )
    # the spec (WEIR_CATALOG_SPEC) reaches the task: its [extract] adds a third job per product
    spec = tmp_path / "shop.toml"
    spec.write_text('[extract.fields]\nunit = { enum = ["g", "kg"] }\n[extract.sampling]\nmax_tokens = 24\n')
    start_worker()
    client.celery_app.send_task(names.ENRICH_CATALOG, args=[str(catalog)], kwargs={"spec": str(spec)},
                                queue=client.queue)

    deadline = time.monotonic() + 60
    batch = None
    while batch is None and time.monotonic() < deadline:
        with client.session_factory() as session:
            batch = session.scalars(select(Batch).where(Batch.meta["catalog"].as_string() == str(catalog),
                                                        Batch.status != BatchStatus.VALIDATING)).first()
        time.sleep(0.2)
    assert batch is not None and batch.num_jobs == 6
    final = client.wait(batch.id, timeout_s=120)
    assert (final.status, final.num_succeeded) == (BatchStatus.COMPLETED, 6)
    with client.session_factory() as session:
        products = session.scalars(
            select(ProductEnrichment.product_id).where(ProductEnrichment.source_batch_id == batch.id)
            .order_by(ProductEnrichment.product_id)).all()
    assert products == ["1", "2"]
    # each field's decision is stored with it, and publishable follows them: every field auto
    with client.session_factory() as session:
        rows = session.execute(text(
            "SELECT l.product_id, l.category_decision, l.description_decision, l.attributes_decision, "
            "p.attributes_wanted, l.publishable FROM latest_enrichment l JOIN product_enrichment p "
            "USING (catalog, product_id) WHERE l.source_batch_id = :b ORDER BY l.product_id"),
            {"b": batch.id}).all()
    assert [r.product_id for r in rows] == ["1", "2"]
    for row in rows:
        decisions = (row.category_decision, row.description_decision, row.attributes_decision)
        assert all(d in ("auto", "review", "reject") for d in decisions), row
        assert row.attributes_wanted is True
        assert row.publishable == all(d == "auto" for d in decisions), row


def test_a_second_nightly_beat_for_the_same_slot_enqueues_nothing(start_worker, client, tmp_path):

    from weir.jobs import names
    from weir.jobs.db import Batch

    catalog = tmp_path / "catalog.csv"
    catalog.write_text("index,product,category,brand,description\r\n1,Green Tea,Beverages,Leafy,A tea.\r\n",
                       encoding="utf-8")
    worker = start_worker()
    control = names.control_queue(client.queue)  # where beat sends it
    slot = "2026-12-01T02:00:00+00:00"
    for _ in range(3):  # a second beat, and a redelivery
        client.celery_app.send_task(names.ENRICH_CATALOG, args=[str(catalog), slot], queue=control)
    wait_until(lambda: worker.log().count(f"slot {slot}: enrichment batch") == 3, timeout_s=60, what="3 runs")

    def num_batches():
        with client.session_factory() as session:
            return session.scalar(select(func.count()).select_from(Batch).where(
                Batch.meta["catalog"].as_string() == str(catalog)))

    assert num_batches() == 1
    with client.session_factory() as session:
        [key] = session.scalars(select(Batch.idempotency_key).where(Batch.meta["catalog"].as_string() == str(catalog)))
    assert key == f"catalog:{catalog}@{slot}"
    with client.session_factory() as session:
        [first] = session.scalars(select(Batch.id).where(Batch.meta["catalog"].as_string() == str(catalog)))
    client.wait(first, timeout_s=120)
    # the next night: nothing changed, so nothing is enqueued (incremental)
    night = "2026-12-02T02:00:00+00:00"
    client.celery_app.send_task(names.ENRICH_CATALOG, args=[str(catalog), night], queue=control)
    wait_until(lambda: f"slot {night}: enrichment batch none, nothing to enrich (0 new, 0 changed, 0 unfinished, 1 unchanged"
               in worker.log(), timeout_s=60, what="the unchanged night")
    assert num_batches() == 1
    # a product changed: the night after enqueues its jobs alone
    catalog.write_text("index,product,category,brand,description\r\n1,Green Tea,Beverages,Leafy,A new tea.\r\n"
                       "2,Soap Bar,Beauty,Clean,\r\n", encoding="utf-8")
    client.celery_app.send_task(names.ENRICH_CATALOG, args=[str(catalog), "2026-12-03T02:00:00+00:00"], queue=control)

    def sizes():
        with client.session_factory() as session:
            return sorted(session.scalars(select(Batch.num_jobs).where(Batch.meta["catalog"].as_string() == str(catalog))))

    wait_until(lambda: sizes() == [2, 4], timeout_s=60, what="the next night's batch of the two changed products")
    assert num_batches() == 2


def test_a_job_with_every_kind_of_sampling_field_stores_what_the_engine_returns(start_worker, client, worker_env):
    from weir.engine import LLM

    start_worker()
    request = GenerateRequest(prompt="Once upon a time", custom_id="full", n=2, temperature=0.8, seed=11,
                              stop=[" the", "\n\n"], min_tokens=2, max_tokens=12, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2)
    batch_id = client.enqueue_batch([request])
    assert client.wait(batch_id, timeout_s=120).status == BatchStatus.COMPLETED

    [want] = LLM(model=worker_env["WEIR_MODEL"], device="cpu").generate([request.engine_prompt()],
                                                                       request.sampling_params())
    [row] = client.results(batch_id)
    assert row["completions"] == [
        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
         "num_tokens": len(c.token_ids), "cumulative_logprob": c.cumulative_logprob,
         "logprobs": [[{"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in position.items()] for position in c.logprobs],
         "parsed": None}
        for c in want.outputs]
    assert len(row["completions"]) == 2
    assert (row["status"], row["output_text"], row["finish_reason"], row["parsed"]) == (
        "succeeded", want.outputs[0].text, want.outputs[0].finish_reason, None)
    assert row["num_completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
    assert {k: row["sampling_params"][k] for k in ("n", "stop", "min_tokens", "logprobs", "presence_penalty")} == {
        "n": 2, "stop": [" the", "\n\n"], "min_tokens": 2, "logprobs": 2, "presence_penalty": 0.5}


def test_only_enrichment_jobs_write_product_enrichment_and_an_oversized_job_fails_at_once(
        start_worker, client, worker_env):
    start_worker()
    # This producer believes the model takes 10**10 tokens, so the worker is the one to refuse.
    client.prompt_checker = PromptChecker(load_tokenizer(worker_env["WEIR_MODEL"]), 10**10)
    requests = [
        ClassifyRequest(prompt="Great tea!", labels=["positive", "negative"], custom_id="sentiment",
                        metadata={"product_id": "shared-1"}),
        GenerateRequest(prompt="Tea", custom_id="summary", max_tokens=3, metadata={"product_id": "shared-1"}),
        ClassifyRequest(prompt="Product: Tea", labels=["Tea", "Soap"], custom_id="category",
                        extensions={"enrichment": {"catalog": "shop-a", "product_id": "shared-1"}}),
        ClassifyRequest(prompt="Product: Soap", labels=["Tea", "Soap"], custom_id="category-b",
                        extensions={"enrichment": {"catalog": "shop-b", "product_id": "shared-1"}}),
        GenerateRequest(prompt="One two", custom_id="huge", max_tokens=10**9),
    ]
    started = time.monotonic()
    batch_id = client.enqueue_batch(requests)
    final = client.wait(batch_id, timeout_s=120)

    assert time.monotonic() - started < 60  # WEIR_JOB_TIMEOUT_S is 600: nothing timed out
    results = {r["custom_id"]: r for r in client.results(batch_id)}
    assert (final.num_succeeded, final.num_failed) == (4, 1)
    assert (results["huge"]["status"], results["huge"]["error"], results["huge"]["attempts"]) == (
        "failed", "ValueError: max_tokens=1000000000 is more than max_model_len=512", 1)
    with client.session_factory() as session:
        rows = session.execute(
            select(ProductEnrichment.catalog, ProductEnrichment.product_id, ProductEnrichment.category)
            .where(ProductEnrichment.source_batch_id == batch_id).order_by(ProductEnrichment.catalog)).all()
    assert [tuple(r) for r in rows] == [("shop-a", "shared-1", results["category"]["label"]),
                                        ("shop-b", "shared-1", results["category-b"]["label"])]


def test_an_interactive_job_runs_ahead_of_a_waiting_bulk_batch(start_worker, client):
    """A bulk batch (the catalog job's priority 9) waits in Redis; a job enqueued after it at the
    interactive priority 0 is taken at once by the interactive lane of a worker whose model queue
    has a one-message window, and its priority reaches the engine's scheduler, which runs it
    ahead of the bulk jobs (one sequence slot: at most one bulk job can end before it)."""
    from weir.jobs.schemas import BULK_PRIORITY

    bulk = client.enqueue_batch([GenerateRequest(prompt=f"bulk {i}", max_tokens=2) for i in range(6)],
                                priority=BULK_PRIORITY)
    interactive = client.enqueue_generate("interactive", max_tokens=2)
    assert client.num_waiting_messages() == 2  # the bulk batch is one chunk's message
    start_worker(WEIR_CONCURRENCY="1", WEIR_MAX_NUM_SEQS="1", WEIR_SCHEDULING_POLICY="priority")
    client.wait(bulk, timeout_s=120)
    client.wait(interactive.batch_id, timeout_s=60)
    with client.session_factory() as session:
        jobs = session.scalars(select(Job).where(Job.batch_id.in_([bulk, interactive.batch_id]))
                               .order_by(Job.finished_at)).all()
    assert [j.batch_id for j in jobs].index(interactive.batch_id) <= 1
    assert sorted(j.request["priority"] for j in jobs) == [0] + [BULK_PRIORITY] * 6
    assert [j.attempts for j in jobs] == [1] * 7


def test_an_openai_batch_past_its_completion_window_is_expired_by_a_sweep_while_workers_run(
        start_worker, worker_env, slow_model_dir):
    """Nobody asks for the batch's status: the sweep task (what beat sends every
    ``WEIR_SWEEP_INTERVAL_S``) expires it on its own once its window has passed, and the workers
    stop running its jobs."""
    import json

    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs import names, openai_batch
    from weir.jobs.client import Client

    client = Client(Settings(
        engine=EngineSettings(model=slow_model_dir),
        worker=WorkerSettings(broker_url=worker_env["WEIR_BROKER_URL"], queue=worker_env["WEIR_QUEUE"]),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"])))
    try:
        start_worker(WEIR_MODEL=slow_model_dir, WEIR_MAX_NUM_SEQS="2", WEIR_CONCURRENCY="2")
        num_requests, window_s = 16, 4
        lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": openai_batch.CHAT_COMPLETIONS,
                             "body": {"model": client.model, "max_tokens": 200, "temperature": 0,
                                      "messages": [{"role": "user", "content": f"Question {i}"}]}})
                 for i in range(num_requests)]  # ~1.2 s a request on the slow model, 2 at a time
        parsed = openai_batch.parse_batch_file(lines, model=client.model)
        batch_id = client.enqueue_batch(parsed.requests, metadata=openai_batch.batch_metadata(
            parsed.endpoint, "in.jsonl", f"{window_s}s"))
        created = time.monotonic()
        wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 1, timeout_s=60, what="a first result")
        time.sleep(max(0.0, created + window_s + 0.5 - time.monotonic()))
        assert not client.batch_status(batch_id).status.is_finished  # the window passed mid-batch
        client.celery_app.send_task(names.SWEEP, queue=names.control_queue(client.queue))
        wait_until(lambda: client.batch_status(batch_id).status.is_finished, timeout_s=60, what="the batch's end")
        batch = openai_batch.batch_object(client.batch_status(batch_id))
        statuses = [job.status for job in client.jobs(batch_id)]
    finally:
        client.close()
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert set(statuses) == {JobStatus.SUCCEEDED, JobStatus.CANCELLED}
    assert batch["request_counts"] == {"total": num_requests, "completed": statuses.count(JobStatus.SUCCEEDED),
                                       "failed": 0}
