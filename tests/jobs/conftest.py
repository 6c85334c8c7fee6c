"""Fixtures of the jobs tests: a producer client on an in-memory broker, session factories."""

import uuid

import pytest
from celery import Celery

from weir.jobs.client import Client
from weir.jobs.db import make_engine, make_session_factory
from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings


@pytest.fixture
def queue():
    return f"weir.test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def celery_app():
    return Celery("weir-test-producer", broker="memory://localhost//", set_as_current=False)


@pytest.fixture
def client(postgres_url, tiny_model_dir, queue, celery_app):
    """A client on the fresh Postgres database, publishing to ``celery_app``'s memory broker."""
    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir),
        worker=WorkerSettings(queue=queue, broker_url=None),
        database=DatabaseSettings(database_url=postgres_url),
    )
    client = Client(settings, celery_app=celery_app)
    yield client
    client.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def session_factory(request, tmp_path):
    """Sessions on the fresh Postgres database, then on a migrated SQLite file."""
    from weir import migrations

    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_url")
    else:
        url = f"sqlite:///{tmp_path / 'weir.db'}"
        migrations.upgrade(url)
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()
