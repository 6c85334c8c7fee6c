"""The real Gemma 3 270M (Q4_K_M GGUF, a base model with sliding-window layers) served by
``weir worker`` with Redis and Postgres: every job succeeds once with the offline engine's exact
greedy text, prompts longer than its 512-token window included."""

import json
import os
import subprocess
import sys

import pytest

from weir.jobs.schemas import GenerateRequest

from tests.engine.test_gemma3_270m import gemma3_path, long_prompt_text
from tests.worker.conftest import REPO_ROOT
from tests.worker.test_faults import assert_each_succeeded_once

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
MAX_MODEL_LEN = 2048  # its 32,768 needs more KV cache than the CPU default holds
THREADS = {"OMP_NUM_THREADS": "1"}  # both sides: the same kernels' reduction order
SHORT = ["The capital of France is", "Water boils at a temperature of", "The three primary colours are"]

OFFLINE = """
import json, sys
from weir import LLM, SamplingParams
prompts = json.loads(sys.stdin.read())
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[3]))
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[2])))
print(json.dumps([o.outputs[0].text for o in outs]))
"""


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


def test_gemma3_through_the_worker_matches_the_offline_engine(start_worker, gemma_client):
    client, path = gemma_client, gemma3_path()
    prompts = SHORT[:2] + [long_prompt_text(i) for i in range(2)]
    out = subprocess.run([sys.executable, "-c", OFFLINE, path, str(MAX_TOKENS), str(MAX_MODEL_LEN)], input=json.dumps(prompts),
                         cwd=REPO_ROOT, env=dict(os.environ, **THREADS), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    offline = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(offline)

    from weir.engine.engine_args import EngineArgs

    start_worker(**THREADS, WEIR_MODEL=path, WEIR_MAX_MODEL_LEN=str(MAX_MODEL_LEN), WEIR_JOB_TIMEOUT_S="300",
                 WEIR_CPU_KV_CACHE_BYTES=str(EngineArgs.cpu_kv_cache_bytes))  # the engine's default, as offline
    batch_id = client.enqueue_batch([GenerateRequest(prompt=p, custom_id=f"job-{i}", temperature=0,
                                                     max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)])
    client.wait(batch_id, timeout_s=600)
    table = assert_each_succeeded_once(client, batch_id, len(prompts))
    assert {c: row[3] for c, row in table.items()} == {f"job-{i}": text for i, text in enumerate(offline)}
