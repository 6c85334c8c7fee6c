"""EngineCoreClient: the engine core in a process of its own, fed from the test's process."""

import os
import signal
import threading
import time

import pytest

from weir.engine import LLM, SamplingParams
from weir.engine.core import EngineDeadError
from weir.engine.core_client import EngineCoreClient

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def engine_args(model_dir, **extra):
    return dict(model=model_dir, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_num_seqs=4,
                max_model_len=256, **extra)


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    c = EngineCoreClient(engine_args(tiny_llama_dir), collect_stats=True)
    yield c
    c.shutdown()


def test_many_threads_get_the_offline_tokens(tiny_llama_dir, client):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(12)]
    llm = LLM(**engine_args(tiny_llama_dir))
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    got = [None] * len(prompts)

    def worker(i):
        got[i] = client.submit_generate(prompts[i], GREEDY).result(timeout=60).outputs[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert client.process.pid != os.getpid() and client.process.is_alive()


def test_bad_input_fails_in_the_caller_or_its_future_only(client):
    with pytest.raises(ValueError, match="prompt is empty"):
        client.submit_generate([], GREEDY)
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        client.submit_generate([5, 6], GREEDY, priority=3)
    refused = client.submit_generate([5, 6, 7], SamplingParams(max_tokens=4, logprobs=10_000))
    ok = client.submit_generate([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="more than max_logprobs"):
        refused.result(timeout=60)
    assert len(ok.result(timeout=60).outputs[0].token_ids) == 6


def test_abort_cancels_the_future_and_frees_the_request(client):
    fut = client.submit_generate([5, 6, 7], LONG)
    client.abort(fut)
    with pytest.raises(Exception):
        fut.result(timeout=60)
    assert fut.cancelled()
    client.submit_generate([8, 9], GREEDY).result(timeout=60)
    assert client.stats()["num_requests_running"] == 0


def test_stat_loggers_get_each_steps_records(client):
    got = []

    class Recorder:
        def record(self, scheduler_stats, iteration_stats):
            got.append(iteration_stats.num_generation_tokens)

    client.stat_loggers.append(Recorder())
    try:
        client.submit_generate([11, 12, 13], GREEDY).result(timeout=60)
    finally:
        client.stat_loggers.clear()
    assert sum(got) == 6


def test_engine_arguments_refused_by_the_core_raise_in_the_caller(tiny_llama_dir):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
        EngineCoreClient(engine_args(tiny_llama_dir) | {"max_model_len": 4096})


def test_a_killed_core_fails_every_request_at_once_and_refuses_new_ones(tiny_llama_dir):
    c = EngineCoreClient(engine_args(tiny_llama_dir))
    futs = [c.submit_generate([5, 6, i + 3], SamplingParams(max_tokens=200, ignore_eos=True))
            for i in range(3)]
    os.kill(c.process.pid, signal.SIGKILL)
    started = time.monotonic()
    for fut in futs:
        with pytest.raises(EngineDeadError, match="the engine core process died: it exited with status -9"):
            fut.result(timeout=30)
    assert time.monotonic() - started < 5  # at once: the pipe closes, no timeout is waited out
    assert c.dead is not None
    with pytest.raises(EngineDeadError):
        c.submit_generate([5, 6], GREEDY)
    c.shutdown()


def test_a_wedged_core_is_killed_and_its_requests_fail(tiny_llama_dir):
    c = EngineCoreClient(engine_args(tiny_llama_dir), iteration_timeout_s=2.0)
    c.submit_generate([5, 6], GREEDY).result(timeout=60)
    os.kill(c.process.pid, signal.SIGSTOP)  # alive, but it steps no more
    fut = c.submit_generate([5, 6, 7], GREEDY)
    with pytest.raises(EngineDeadError, match="wedged"):
        fut.result(timeout=30)
    assert not c.process.is_alive()
    c.shutdown()


def test_shutdown_drains_and_the_core_process_exits(tiny_llama_dir):
    c = EngineCoreClient(engine_args(tiny_llama_dir))
    futs = [c.submit_generate([9, 9, i + 3], GREEDY) for i in range(6)]
    c.shutdown(drain=True)
    assert all(len(f.result(timeout=0).outputs[0].token_ids) == 6 for f in futs)
    assert c.process.exitcode == 0
    with pytest.raises(RuntimeError, match="shutting down"):
        c.submit_generate([5], GREEDY)
