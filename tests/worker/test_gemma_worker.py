"""The real Gemma 3 270M (Q4_K_M GGUF, a base model with sliding-window layers) served by
``weir worker`` with Redis and Postgres: every job succeeds once with transformers' exact greedy
text (``tests/data/references/gemma3_270m.json``, which the offline engine matches in
``tests/engine/test_gemma3_270m.py``) on prompts longer than its 512-token window."""

import pytest

from weir.jobs.schemas import GenerateRequest

from tests.engine.references import read_reference
from tests.engine.test_gemma3_270m import gemma3_path, long_prompt_text
from tests.worker.test_faults import assert_each_succeeded_once

pytestmark = pytest.mark.integration

NUM_JOBS = 4
MAX_MODEL_LEN = 2048  # its 32,768 needs more KV cache than the CPU default holds
THREADS = {"OMP_NUM_THREADS": "1"}  # the job side keeps a core


@pytest.fixture
def gemma_client(worker_env):
    """A producer ``Client`` whose model is Gemma 3 (it checks prompts with that tokenizer)."""
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client

    client = Client(Settings(
        engine=EngineSettings(model=gemma3_path(), max_model_len=MAX_MODEL_LEN),
        worker=WorkerSettings(broker_url=worker_env["WEIR_BROKER_URL"], queue=worker_env["WEIR_QUEUE"]),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"])))
    yield client
    client.close()


def test_gemma3_through_the_worker_gives_transformers_greedy_text(start_worker, gemma_client):
    client, path = gemma_client, gemma3_path()
    ref = read_reference("gemma3_270m")
    prompts = [long_prompt_text(i) for i in range(NUM_JOBS)]
    tokenizer = client.prompt_checker.tokenizer  # the one the client checks the prompts with
    assert [tokenizer(p).input_ids for p in prompts] == ref["prompts"][:NUM_JOBS]  # what the worker encodes
    want = [tokenizer.decode(t, skip_special_tokens=True) for t in ref["tokens"][:NUM_JOBS]]

    from weir.engine.engine_args import EngineArgs

    start_worker(**THREADS, WEIR_MODEL=path, WEIR_MAX_MODEL_LEN=str(MAX_MODEL_LEN), WEIR_JOB_TIMEOUT_S="300",
                 WEIR_CPU_KV_CACHE_BYTES=str(EngineArgs.cpu_kv_cache_bytes))  # the engine's default, as offline
    batch_id = client.enqueue_batch([GenerateRequest(prompt=p, custom_id=f"job-{i}", temperature=0,
                                                     max_tokens=ref["max_tokens"]) for i, p in enumerate(prompts)])
    client.wait(batch_id, timeout_s=600)
    table = assert_each_succeeded_once(client, batch_id, NUM_JOBS)
    assert {c: row[3] for c, row in table.items()} == {f"job-{i}": text for i, text in enumerate(want)}
