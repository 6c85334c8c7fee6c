import collections
import os
import uuid

import pytest

from sqlalchemy import text

from weir.worker import testing
from weir.worker.testing import WorkerProcess, delete_queue_keys


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory):
    """The tiny chat model with 16 layers instead of 2: ~6 ms a token on the 2-core VM, so a
    480-token job runs ~3 s while a 1-token job takes ~10 ms (for timeouts, grace periods and
    cancels that must catch a job in flight, whatever the engine's speed-ups)."""
    from weir.jobs.testing import save_tiny_chat_model

    return save_tiny_chat_model(str(tmp_path_factory.mktemp("slow-chat-llama")), num_hidden_layers=16)


@pytest.fixture
def queue(redis_url):
    """A queue name no other run uses; its Redis keys are deleted afterwards."""
    import redis

    name = f"weir.test-{uuid.uuid4().hex[:12]}"
    yield name
    delete_queue_keys(redis.Redis.from_url(redis_url), name)


@pytest.fixture
def worker_env(postgres_url, tiny_model_dir, redis_url, queue):
    """The environment of a ``weir worker`` on the tiny chat model, 4 threads, this test's queue."""
    return testing.worker_env(broker_url=redis_url, queue=queue, database_url=postgres_url, model=tiny_model_dir,
                              concurrency=4, python_path=[REPO_ROOT])


@pytest.fixture
def client(worker_env):
    """A producer ``Client`` for the workers' queue, database and model."""
    from weir.jobs.client import Client
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings

    settings = Settings(
        engine=EngineSettings(model=worker_env["WEIR_MODEL"]),
        worker=WorkerSettings(broker_url=worker_env["WEIR_BROKER_URL"], queue=worker_env["WEIR_QUEUE"]),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"]),
    )
    client = Client(settings)
    yield client
    client.close()


@pytest.fixture
def start_worker(worker_env, tmp_path):
    """Start ``weir worker`` processes (env overrides as keyword arguments); all killed at the end."""
    started = []

    def start(**overrides) -> WorkerProcess:
        env = dict(worker_env, **overrides)
        worker = WorkerProcess(env, str(tmp_path / f"worker-{len(started)}.log"), cwd=REPO_ROOT)
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.kill()


EFFECT_TRIGGERS = """
CREATE TABLE IF NOT EXISTS test_effects (tbl text, key text, n integer NOT NULL, PRIMARY KEY (tbl, key));
CREATE OR REPLACE FUNCTION test_count_effect() RETURNS trigger AS $$
BEGIN
  INSERT INTO test_effects VALUES (TG_TABLE_NAME, to_jsonb(NEW) ->> TG_ARGV[0], 1)
  ON CONFLICT (tbl, key) DO UPDATE SET n = test_effects.n + 1;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS test_result_writes ON jobs;
CREATE TRIGGER test_result_writes AFTER INSERT OR UPDATE ON jobs FOR EACH ROW
  WHEN (NEW.status IN ('succeeded', 'failed')) EXECUTE FUNCTION test_count_effect('id');
DROP TRIGGER IF EXISTS test_enrichment_writes ON product_enrichment;
CREATE TRIGGER test_enrichment_writes AFTER INSERT OR UPDATE ON product_enrichment FOR EACH ROW
  EXECUTE FUNCTION test_count_effect('product_id');
"""


@pytest.fixture
def effects(client):
    """Counts of result writes (``jobs`` rows set to a final outcome) and enrichment writes."""
    with client.engine.begin() as connection:
        connection.exec_driver_sql(EFFECT_TRIGGERS)

    def counts(table, keys):
        with client.session_factory() as session:
            found = dict(session.execute(
                text("SELECT key, n FROM test_effects WHERE tbl = :t AND key = ANY(:k)"),
                {"t": table, "k": [str(k) for k in keys]}).all())
        return {str(k): found.get(str(k), 0) for k in keys}

    return counts


@pytest.fixture
def hooked(worker_env, tmp_path):
    """Env for a worker with the test hooks, and a reader of its engine-run log."""
    run_log = tmp_path / "runs.log"
    env = dict(WEIR_TEST_RUN_LOG=str(run_log),
               PYTHONPATH=os.path.join(HERE, "crash_hook") + os.pathsep + worker_env["PYTHONPATH"])

    def runs():
        if not run_log.exists():
            return collections.Counter()
        return collections.Counter(run_log.read_text().split())

    return env, runs
