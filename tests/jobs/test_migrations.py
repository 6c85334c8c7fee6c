"""The Alembic migrations: reversible, and in step with the SQLAlchemy models."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from weir import migrations
from weir.jobs.db import Base, make_engine
from tests import support

TABLES = {"alembic_version", "batches", "dead_letters", "jobs", "product_enrichment"}
VIEWS = {"batch_summary", "failed_jobs", "latest_enrichment"}


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'weir.db'}"
        return
    with support.fresh_postgres_database() as url:  # a second fresh database: this one is emptied
        migrations.downgrade(url, "base")
        yield url


def table_names(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def view_names(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_view_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_round_trip(empty_url):
    assert migrations.current_revision(empty_url) is None
    migrations.upgrade(empty_url)
    assert migrations.current_revision(empty_url) == migrations.head_revision()
    assert (table_names(empty_url), view_names(empty_url)) == (TABLES, VIEWS)
    migrations.downgrade(empty_url, "20261202_0006")
    assert (table_names(empty_url), view_names(empty_url)) == (TABLES, set())
    migrations.downgrade(empty_url, "base")
    assert migrations.current_revision(empty_url) is None
    assert table_names(empty_url) == {"alembic_version"}
    migrations.upgrade(empty_url)
    assert (table_names(empty_url), view_names(empty_url)) == (TABLES, VIEWS)


def test_models_match_migrations(empty_url):
    from weir.jobs.applications import load_tables

    load_tables()  # the applications' tables (product_enrichment) on the core's metadata
    migrations.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_revision_files_are_named_by_date_and_slug():
    import os
    import re

    names = sorted(os.listdir(os.path.join(migrations.SCRIPT_LOCATION, "versions")))
    revisions = [n for n in names if n.endswith(".py")]
    assert revisions and all(re.fullmatch(r"\d{8}_\d{4}_[a-z0-9_]+\.py", n) for n in revisions)


def test_enrichment_rows_take_their_batch_catalog_and_downgrade_keeps_the_newest(empty_url):
    from sqlalchemy import text

    migrations.upgrade(empty_url, "20261201_0003")
    engine = make_engine(empty_url)
    batch_a, batch_b = "0" * 31 + "a", "0" * 31 + "b"
    if engine.dialect.name == "postgresql":
        batch_a, batch_b = (f"00000000-0000-0000-0000-{b[-12:]}" for b in (batch_a, batch_b))
    try:
        with engine.begin() as connection:
            for batch_id, meta in ((batch_a, '{"catalog": "/data/a.csv"}'), (batch_b, "{}")):
                connection.execute(text(
                    "INSERT INTO batches (id, status, model, num_jobs, num_succeeded, num_failed, num_cancelled, "
                    "created_at, metadata) VALUES (:id, 'completed', 'm', 0, 0, 0, 0, '2026-12-01 00:00:00+00', "
                    ":meta)"), {"id": batch_id, "meta": meta})
            for product_id, batch_id in (("1", batch_a), ("2", batch_b)):
                connection.execute(text(
                    "INSERT INTO product_enrichment (product_id, category, model, source_batch_id, updated_at) "
                    "VALUES (:p, 'Tea', 'm', :b, '2026-12-01 00:00:00+00')"), {"p": product_id, "b": batch_id})
        migrations.upgrade(empty_url)
        with engine.begin() as connection:
            assert connection.execute(text(
                "SELECT catalog, product_id FROM product_enrichment ORDER BY product_id")).all() == [
                ("/data/a.csv", "1"), ("", "2")]
            connection.execute(text(  # another catalog's product 1, written later
                "INSERT INTO product_enrichment (catalog, product_id, category, model, updated_at) "
                "VALUES ('/data/b.csv', '1', 'Soap', 'm', '2026-12-02 00:00:00+00')"))
        migrations.downgrade(empty_url, "20261201_0003")
        with engine.begin() as connection:
            assert connection.execute(text(
                "SELECT product_id, category FROM product_enrichment ORDER BY product_id")).all() == [
                ("1", "Soap"), ("2", "Tea")]
    finally:
        engine.dispose()


def test_the_reader_role_is_shared_by_the_databases_of_one_server():
    """Upgrade, downgrade, upgrade one database while another on the same server keeps its
    grants: the role is created only when missing and a downgrade never drops it."""
    from sqlalchemy import text

    def reader_state(url):
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                return connection.execute(text(
                    "SELECT (SELECT count(*) FROM pg_roles WHERE rolname = 'weir_reader'), "
                    "has_table_privilege('weir_reader', 'batches', 'SELECT'), "
                    "has_table_privilege('weir_reader', 'batches', 'INSERT'), "
                    "(SELECT count(*) FROM pg_trigger WHERE tgrelid = 'batches'::regclass AND NOT tgisinternal), "
                    "has_schema_privilege('weir_reader', current_schema(), 'USAGE')")).one()
        finally:
            engine.dispose()

    with support.fresh_postgres_database() as first, support.fresh_postgres_database() as second:
        assert reader_state(first) == reader_state(second) == (1, True, False, 2, True)
        migrations.downgrade(first, "20261202_0006")
        assert reader_state(first)[:4] == (1, False, False, 0)
        assert reader_state(second) == (1, True, False, 2, True)
        migrations.upgrade(first)
        assert reader_state(first) == reader_state(second) == (1, True, False, 2, True)


def test_the_catalog_mark_moves_under_extensions_and_back(empty_url):
    import json

    from sqlalchemy import text

    migrations.upgrade(empty_url, "20261202_0008")
    engine = make_engine(empty_url)
    batch, marked, plain = ("0" * 31 + c for c in "abc")
    if engine.dialect.name == "postgresql":
        batch, marked, plain = (f"00000000-0000-0000-0000-{b[-12:]}" for b in (batch, marked, plain))
    mark = {"catalog": "/data/a.csv", "product_id": "7", "field": "description"}
    stored = {marked: {"prompt": "p", "metadata": {}, "enrichment": mark}, plain: {"prompt": "q", "metadata": {}}}

    def requests():
        with engine.begin() as connection:
            rows = connection.execute(text("SELECT id, request FROM jobs ORDER BY batch_index")).all()
        return [r if isinstance(r, dict) else json.loads(r) for _, r in rows]

    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO batches (id, status, model, num_jobs, num_succeeded, num_failed, num_cancelled, "
                "created_at, metadata) VALUES (:id, 'queued', 'm', 2, 0, 0, 0, '2026-12-01 00:00:00+00', '{}')"),
                {"id": batch})
            for index, job_id in enumerate((marked, plain)):
                connection.execute(text(
                    "INSERT INTO jobs (id, batch_id, batch_index, custom_id, kind, model, request, status, "
                    "attempts, lease_token, queued_at) VALUES (:id, :b, :i, :c, 'generate', 'm', :r, 'queued', 0, 0, "
                    "'2026-12-01 00:00:00+00')"),
                    {"id": job_id, "b": batch, "i": index, "c": str(index), "r": json.dumps(stored[job_id])})
        migrations.upgrade(empty_url)
        assert requests() == [{"prompt": "p", "metadata": {}, "extensions": {"enrichment": mark}},
                              {"prompt": "q", "metadata": {}}]
        migrations.downgrade(empty_url, "20261202_0008")
        assert requests() == [stored[marked], stored[plain]]
    finally:
        engine.dispose()


def test_decisions_join_the_enrichment_rows_and_publishable_needs_them(empty_url):
    from sqlalchemy import text

    migrations.upgrade(empty_url, "20261205_0009")
    engine = make_engine(empty_url)

    def read():
        with engine.begin() as connection:
            return [tuple(bool(v) if k == "publishable" else v for k, v in row._mapping.items())
                    for row in connection.execute(text(
                        "SELECT product_id, publishable FROM latest_enrichment ORDER BY product_id"))]

    try:
        with engine.begin() as connection:
            for product_id in ("1", "2"):
                connection.execute(text(
                    "INSERT INTO product_enrichment (catalog, product_id, category, description, quality, model, "
                    "updated_at) VALUES ('/c.csv', :p, 'Tea', 'A tea.', 'ok', 'm', '2026-12-05 00:00:00+00')"),
                    {"p": product_id})
        assert read() == [("1", True), ("2", True)]
        migrations.upgrade(empty_url)
        assert read() == [("1", False), ("2", False)]  # written before decisions: not publishable
        with engine.begin() as connection:
            connection.execute(text(
                "UPDATE product_enrichment SET category_decision = 'auto', description_decision = 'auto', "
                "description_reasons = '[]'"))
            connection.execute(text("UPDATE product_enrichment SET attributes_wanted = true, "
                                    "attributes_decision = 'review' WHERE product_id = '2'"))
        assert read() == [("1", True), ("2", False)]
        migrations.downgrade(empty_url, "20261205_0009")
        assert read() == [("1", True), ("2", True)]
        assert "description_decision" not in {c["name"] for c in inspect(engine).get_columns("product_enrichment")}
    finally:
        engine.dispose()
