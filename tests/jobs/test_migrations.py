"""The Alembic migrations: reversible, and in step with the SQLAlchemy models."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from weir import migrations
from weir.jobs.db import Base, make_engine
from tests import support

TABLES = {"alembic_version", "batches", "dead_letters", "jobs", "product_enrichment"}


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


def test_upgrade_downgrade_round_trip(empty_url):
    assert migrations.current_revision(empty_url) is None
    migrations.upgrade(empty_url)
    assert migrations.current_revision(empty_url) == migrations.head_revision()
    assert table_names(empty_url) == TABLES
    migrations.downgrade(empty_url, "base")
    assert migrations.current_revision(empty_url) is None
    assert table_names(empty_url) == {"alembic_version"}
    migrations.upgrade(empty_url)
    assert table_names(empty_url) == TABLES


def test_models_match_migrations(empty_url):
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
