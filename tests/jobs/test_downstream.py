"""The downstream contract (docs/downstream.md), played by a downstream service: it listens on
``weir_batch``, batches move through the store's transitions, and it reads the views as
``weir_reader``. The views' columns and the queries' indexes are read from the page itself."""

import json
import os
import re
from datetime import datetime, timezone

import psycopg
import pytest
from sqlalchemy import make_url, text

from tests import support
from weir.jobs.batches import (
    add_jobs, begin_batch, cancel_batch, cancel_job, delete_batch, get_batch, list_jobs, queue_batch,
)
from weir.jobs.catalog import store as catalog_store
from weir.jobs.claims import claim_jobs
from weir.jobs.db import JobStatus, make_engine, make_session_factory
from weir.jobs.results import JobResult, record_results, uuid_literal
from weir.jobs.schemas import ClassifyRequest, GenerateRequest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "downstream.md")
CATALOG = "/data/catalog.csv"
CHANNEL = "weir_batch"
SENTINEL = '{"sentinel": true}'
VIEWS = ("latest_enrichment", "batch_summary", "failed_jobs")
TABLES = ("batches", "jobs", "product_enrichment", "dead_letters")


def documented_columns() -> dict[str, list[str]]:
    """Each view's column names as the page's table under its ``### `view` `` heading lists them."""
    columns: dict[str, list[str]] = {}
    view = None
    for line in open(DOC, encoding="utf-8"):
        heading = re.fullmatch(r"### `(\w+)`\n", line)
        if heading:
            view = heading.group(1)
            columns[view] = []
        elif line.startswith("## "):
            view = None
        elif view is not None and (cell := re.match(r"\| `(\w+)` \|", line)):
            columns[view].append(cell.group(1))
    return columns


def documented_queries() -> list[tuple[str, str]]:
    """(index name, SQL) of every ```sql block of the page that names its index."""
    blocks = re.findall(r"```sql\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)
    return [(m.group(1), block[m.end():].strip()) for block in blocks
            if (m := re.match(r"-- index: (\w+)\n", block))]


@pytest.fixture
def conninfo(postgres_url):
    return make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def pg_sessions(postgres_url):
    engine = make_engine(postgres_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def listener(conninfo):
    """A downstream service's connection, listening on the channel before anything happens."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


@pytest.fixture
def reader(conninfo):
    """A connection acting as ``weir_reader`` (autocommit: a refused statement ends nothing)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SET ROLE weir_reader")
        yield conn


def changes(listener, conninfo) -> dict[str, list[dict]]:
    """Every payload received so far, per batch id, in the order received.

    A sentinel notified after the changes marks the end: notifications arrive in commit order, so
    every change committed before it has arrived once it has (the timeout only guards a hang).
    """
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, SENTINEL))
    received: dict[str, list[dict]] = {}
    for notify in listener.notifies(timeout=30):
        assert notify.channel == CHANNEL
        if notify.payload == SENTINEL:
            return received
        payload = json.loads(notify.payload)
        received.setdefault(payload["batch_id"], []).append(payload)
    raise AssertionError(f"the sentinel never arrived; received {received}")


def statuses(payloads):
    return [(p["status"], p["num_jobs"], p["num_succeeded"], p["num_failed"], p["num_cancelled"]) for p in payloads]


LISTING = {"name": "Green Tea", "brand": "Leafy", "description": "Fresh green tea leaves."}


def enriching(product_id, field=None, **more):
    return {"catalog": CATALOG, "product_id": product_id, **({"field": field} if field else {}), **more}


def ok(**fields):
    return JobResult(status=JobStatus.SUCCEEDED, finish_reason="stop", **fields)


def test_a_downstream_service_follows_a_batch_and_reads_what_the_docs_say(
        pg_sessions, listener, reader, conninfo):
    requests = [
        ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id="p1/category", extensions={"enrichment": enriching("p1")}),
        GenerateRequest(prompt="p", custom_id="p1/description",
                        extensions={"enrichment": enriching("p1", listing=LISTING)}),
        GenerateRequest(prompt="p", custom_id="p1/attributes", response_format={"type": "json_object"},
                        extensions={"enrichment": enriching("p1", "attributes", listing=LISTING)}),
        GenerateRequest(prompt="p", custom_id="p2/description", extensions={"enrichment": enriching("p2")}),
        GenerateRequest(prompt="p", custom_id="p3/description", extensions={"enrichment": enriching("p3")}),
        ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id="p4/category", extensions={"enrichment": enriching("p4")}),
        ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id="p3/category", extensions={"enrichment": enriching("p3")}),
    ]
    # The transactions of Client.enqueue_batch, then of the workers.
    with pg_sessions.begin() as session:
        batch_id = begin_batch(session, model="tiny",
                               metadata={"kind": "catalog_enrichment", "catalog": CATALOG}).id
    with pg_sessions.begin() as session:
        add_jobs(session, batch_id, requests, first_index=0, model="tiny", published_at=None)
        queue_batch(session, batch_id, len(requests))
    with pg_sessions() as session:
        job_ids = [job.id for job in list_jobs(session, batch_id)]
    with pg_sessions.begin() as session:
        claims = claim_jobs(session, job_ids[:6], worker="w1", lease_s=60)
    jobs = [claims[job_id].job for job_id in job_ids[:6]]
    with pg_sessions.begin() as session:  # moves num_cancelled, not the status
        cancel_job(session, job_ids[6])
    outcomes = [
        (jobs[0], ok(label="Tea", label_probs={"Tea": 0.75, "Soap": 0.25})),
        (jobs[1], ok(output_text="Fresh green tea.")),
        (jobs[2], ok(output_text='{"colour": "green"}', parsed={"colour": "green"})),
        (jobs[3], ok(output_text="Mild soap with")),
        (jobs[4], JobResult.failure("boom")),
        (jobs[5], ok(label="Soap", label_probs={"Tea": 0.5, "Soap": 0.5})),
    ]
    with pg_sessions.begin() as session:
        written = record_results(session, outcomes)
        catalog_store.record_enrichments(session, [o for o in outcomes if o[0].id in written], model="tiny")

    received = changes(listener, conninfo)
    assert statuses(received[str(batch_id)]) == [
        ("validating", 0, 0, 0, 0), ("queued", 7, 0, 0, 0), ("in_progress", 7, 0, 0, 0),
        ("completed", 7, 5, 1, 1)]
    assert list(received[str(batch_id)][-1]) == [
        "batch_id", "status", "num_jobs", "num_succeeded", "num_failed", "num_cancelled"]

    with pg_sessions() as session:
        batch = get_batch(session, batch_id)
        failed = list_jobs(session, batch_id)[4]
    summary = reader.execute("SELECT * FROM batch_summary WHERE batch_id = %s", (batch_id,)).fetchall()
    assert summary == [(batch_id, "completed", "tiny", "catalog_enrichment", CATALOG, 7, 5, 1, 1,
                        batch.created_at, batch.started_at, batch.finished_at)]
    assert batch.started_at is not None and batch.finished_at is not None
    assert reader.execute("SELECT * FROM failed_jobs WHERE batch_id = %s ORDER BY batch_index",
                          (batch_id,)).fetchall() == [
        (batch_id, failed.id, 4, "p3/description", "generate", "boom", 1, failed.finished_at)]
    rows = reader.execute("SELECT * FROM latest_enrichment WHERE source_batch_id = %s ORDER BY product_id",
                          (batch_id,)).fetchall()
    updated_at = rows[0][-1]
    unfinished = [{"code": "unfinished", "text": "Mild soap with"}]
    assert rows == [
        (CATALOG, "p1", "Tea", 0.75, "llm", "auto", [], "Fresh green tea.", "ok", "auto", [], True,
         {"colour": "green"}, "auto", [], None, "tiny", batch_id, batch.created_at, updated_at),
        (CATALOG, "p2", None, None, None, None, None, "Mild soap with", "unfinished", "reject", unfinished, False,
         None, None, None, None, "tiny", batch_id, batch.created_at, updated_at),
        (CATALOG, "p4", "Soap", 0.5, "llm", "auto", [], None, None, None, None, False, None, None, None, None,
         "tiny", batch_id, batch.created_at, updated_at),
    ]
    assert reader.execute("SELECT product_id FROM latest_enrichment WHERE source_batch_id = %s AND publishable",
                          (batch_id,)).fetchall() == [("p1",)]


def test_every_other_end_of_a_batch_is_notified_once(pg_sessions, listener, conninfo):
    with pg_sessions.begin() as session:  # validating and queued in one transaction: both sent
        cancelled, _ = support.create_batch(session, [GenerateRequest(prompt="a"), GenerateRequest(prompt="b")],
                                            model="tiny")
    with pg_sessions.begin() as session:
        cancel_batch(session, cancelled.id)
        cancel_batch(session, cancelled.id)  # already finished: no change, nothing sent
    with pg_sessions.begin() as session:
        failed, [job] = support.create_batch(session, [GenerateRequest(prompt="a")], model="tiny")
    with pg_sessions.begin() as session:
        job = support.claim_job(session, job.id)
    with pg_sessions.begin() as session:
        support.record_result(session, job, JobResult.failure("boom"))
    with pg_sessions.begin() as session:
        abandoned = begin_batch(session, model="tiny")
    with pg_sessions.begin() as session:
        delete_batch(session, abandoned.id)
    with pg_sessions.begin() as session:  # rolled back: nothing sent
        begin_batch(session, model="tiny")
        session.rollback()

    received = changes(listener, conninfo)
    assert {batch_id: statuses(payloads) for batch_id, payloads in received.items()} == {
        str(cancelled.id): [("validating", 0, 0, 0, 0), ("queued", 2, 0, 0, 0), ("cancelled", 2, 0, 0, 2)],
        str(failed.id): [("validating", 0, 0, 0, 0), ("queued", 1, 0, 0, 0), ("in_progress", 1, 0, 0, 0),
                         ("failed", 1, 0, 1, 0)],
        str(abandoned.id): [("validating", 0, 0, 0, 0), ("deleted", 0, 0, 0, 0)],
    }


def test_weir_reader_reads_every_view_and_table_and_writes_nothing(reader):
    assert reader.execute("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'weir_reader'").fetchall() == [(False,)]
    for name in VIEWS + TABLES:
        reader.execute(f"SELECT * FROM {name} LIMIT 1").fetchall()
    writes = [
        "INSERT INTO batches (id, status, model, num_jobs, num_succeeded, num_failed, num_cancelled, created_at, "
        "metadata) VALUES (gen_random_uuid(), 'queued', 'm', 0, 0, 0, 0, now(), '{}')",
        "UPDATE jobs SET error = 'x'",
        "DELETE FROM product_enrichment",
        "DELETE FROM dead_letters",
        "UPDATE latest_enrichment SET description = 'x'",
        "UPDATE batch_summary SET status = 'failed'",
        "DELETE FROM failed_jobs",
        "TRUNCATE batches",
    ]
    for statement in writes:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(statement)


def test_the_views_have_the_documented_columns(session_factory):
    columns = documented_columns()
    assert sorted(columns) == sorted(VIEWS)
    with session_factory.begin() as session:
        batch, _ = support.create_batch(session, [GenerateRequest(prompt="a")], model="tiny",
                                        metadata={"kind": "catalog_enrichment", "catalog": CATALOG})
        for view in VIEWS:
            assert list(session.execute(text(f"SELECT * FROM {view}")).keys()) == columns[view], view
        found = session.execute(text("SELECT kind, catalog, num_jobs FROM batch_summary WHERE batch_id = :id"),
                                {"id": uuid_literal(batch.id, session.get_bind().dialect.name)}).all()
    assert found == [("catalog_enrichment", CATALOG, 1)]


def test_each_documented_query_uses_the_index_it_names():
    """On a database with statistics of a real shape (a batch of 2,000 jobs, 2 of them failed;
    2,000 enrichment rows), so the planner weighs the indexes as it would in production."""
    from tests import support

    queries = documented_queries()
    assert len(queries) == 7
    with support.fresh_postgres_database() as url:
        engine = make_engine(url)
        try:
            with make_session_factory(engine).begin() as session:
                batch_id = begin_batch(session, model="tiny").id
                add_jobs(session, batch_id, [GenerateRequest(prompt="p")] * 2000, first_index=0,
                         model="tiny", published_at=None)
                queue_batch(session, batch_id, 2000)
                session.execute(text("UPDATE jobs SET status = 'failed' WHERE batch_index < 2"))
                session.execute(text(
                    "INSERT INTO product_enrichment (catalog, product_id, description, quality, model, "
                    "source_batch_id, updated_at) SELECT :catalog, i::text, 'd.', 'ok', 'tiny', "
                    "CASE WHEN i % 2 = 0 THEN CAST(:batch_id AS uuid) END, now() - i * interval '1 minute' "
                    "FROM generate_series(1, 2000) AS i"), {"catalog": CATALOG, "batch_id": str(batch_id)})
            with engine.connect() as connection:
                connection.execute(text("ANALYZE"))
                connection.commit()
        finally:
            engine.dispose()
        conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        params = {"batch_id": batch_id, "since": datetime(2026, 12, 1, tzinfo=timezone.utc),
                  "catalog": CATALOG, "product_id": "7", "after": "1000"}
        with psycopg.connect(conninfo, autocommit=True, cursor_factory=psycopg.ClientCursor) as reader:
            reader.execute("SET ROLE weir_reader")
            reader.execute("SET enable_seqscan = off")  # a table of a few rows is otherwise scanned
            for index, sql in queries:
                plan = "\n".join(row[0] for row in reader.execute("EXPLAIN " + sql, params).fetchall())
                assert re.search(rf"Index (Only )?Scan (Backward )?(using|on) {index}\b", plan), (index, sql, plan)
