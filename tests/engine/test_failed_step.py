"""After a step that raises: the prefix cache holds only computed blocks, the step's requests end
with EngineStepError, everything else keeps working."""

import threading

import pytest

from weir.engine import EngineFront, LLM, SamplingParams
from weir.engine.front import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 37 tokens: two full 16-token blocks that a second request with this prompt would hit
SYSTEM_PROMPT = [(11 * j) % 250 + 3 for j in range(37)]


def make_llm(path, **kw):
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(path, **kw)


def fail_next_execute(engine, times=1):
    """Make the runner's next ``times`` calls to ``execute`` raise RuntimeError."""
    real = engine.runner.execute
    left = [times]

    def execute(sched):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("device fault")
        return real(sched)

    engine.runner.execute = execute


def run_all(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def assert_idle(engine):
    pool = engine.block_pool
    assert not engine.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.kv.req_blocks == {}


@pytest.fixture(scope="module")
def fresh_tokens(tiny_llama_dir):
    return make_llm(tiny_llama_dir).generate([SYSTEM_PROMPT], GREEDY)[0].outputs[0].token_ids


def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_llama_dir, fresh_tokens):
    engine = make_llm(tiny_llama_dir).llm_engine
    fail_next_execute(engine)
    engine.add_request(SYSTEM_PROMPT, GREEDY, request_id="first")
    with pytest.raises(EngineStepError):
        engine.step()
    engine.abort("first")  # no-op once the engine ends the step's requests itself
    assert engine.block_pool.cached == {}
    rid = engine.add_request(SYSTEM_PROMPT, GREEDY)
    out = run_all(engine)[rid]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh_tokens
    assert_idle(engine)


def test_failed_step_keeps_blocks_computed_by_earlier_steps(tiny_llama_dir, fresh_tokens):
    engine = make_llm(tiny_llama_dir).llm_engine
    engine.add_request(SYSTEM_PROMPT, GREEDY, request_id="done")
    run_all(engine)
    fail_next_execute(engine)
    engine.add_request(SYSTEM_PROMPT, GREEDY, request_id="failed")
    with pytest.raises(EngineStepError):
        engine.step()
    rid = engine.add_request(SYSTEM_PROMPT, GREEDY)
    out = run_all(engine)[rid]
    assert out.num_cached_tokens == 32  # the first request's two full blocks
    assert out.outputs[0].token_ids == fresh_tokens


def test_failed_step_names_its_requests_and_spares_the_others(tiny_llama_dir):
    engine = make_llm(tiny_llama_dir, max_num_seqs=1).llm_engine
    engine.add_request([5, 6, 7], GREEDY, request_id="in-step")
    engine.add_request([8, 9], GREEDY, request_id="waiting")
    fail_next_execute(engine)
    with pytest.raises(EngineStepError) as err:
        engine.step()
    assert err.value.request_ids == ["in-step"]
    assert isinstance(err.value.__cause__, RuntimeError)
    outs = run_all(engine)
    assert list(outs) == ["waiting"]
    assert outs["waiting"].outputs[0].token_ids == make_llm(tiny_llama_dir).generate(
        [[8, 9]], GREEDY)[0].outputs[0].token_ids
    assert_idle(engine)


def test_llm_generate_raises_engine_step_error_and_stays_usable(tiny_llama_dir, fresh_tokens):
    llm = make_llm(tiny_llama_dir)
    fail_next_execute(llm.llm_engine)
    with pytest.raises(EngineStepError):
        llm.generate([SYSTEM_PROMPT, [4, 5, 6]], GREEDY)
    assert_idle(llm.llm_engine)
    assert llm.generate([SYSTEM_PROMPT], GREEDY)[0].outputs[0].token_ids == fresh_tokens


def test_front_fails_the_step_requests_and_serves_later_ones(tiny_llama_dir, fresh_tokens):
    llm = make_llm(tiny_llama_dir)
    fail_next_execute(llm.llm_engine)
    front = EngineFront(llm)
    try:
        failed = front.submit_generate(SYSTEM_PROMPT, GREEDY)
        with pytest.raises(EngineStepError):
            failed.result(timeout=60)
        assert front.consecutive_step_failures == 1
        later = front.submit_generate(SYSTEM_PROMPT, GREEDY)
        assert later.result(timeout=60).outputs[0].token_ids == fresh_tokens
        assert front.consecutive_step_failures == 0
    finally:
        front.shutdown()
    assert_idle(llm.llm_engine)


def test_a_cancelled_future_does_not_stop_the_step_loop(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    real = engine.runner.execute
    entered, go = threading.Event(), threading.Event()
    armed = [True]

    def execute(sched):  # the first step waits until the caller has cancelled, then fails
        if armed[0]:
            armed[0] = False
            entered.set()
            go.wait(30)
            raise RuntimeError("device fault")
        return real(sched)

    engine.runner.execute = execute
    front = EngineFront(llm)
    try:
        fut = front.submit_generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        assert entered.wait(30)
        assert fut.cancel()
        go.set()
        later = front.submit_generate([5, 6, 7], GREEDY)
        assert len(later.result(timeout=60).outputs[0].token_ids) == 8
        assert front._thread.is_alive()
    finally:
        front.shutdown(timeout_s=60)
    assert_idle(engine)


def test_a_cancelled_future_aborts_its_request(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    front = EngineFront(llm)
    try:
        slow = front.submit_generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        fast = front.submit_generate([8, 9], GREEDY)
        assert fast.result(timeout=60)  # the slow one is running by now
        slow.cancel()
        done = front.submit_generate([8, 9], GREEDY)
        done.result(timeout=60)
    finally:
        front.shutdown(timeout_s=60)
    assert slow.cancelled()
    assert llm.stats()["num_generation_tokens"] == 16  # the cancelled one stopped: not 200 more
    assert_idle(llm.llm_engine)


def test_two_live_requests_with_one_id_are_refused(tiny_llama_dir):
    engine = make_llm(tiny_llama_dir).llm_engine
    engine.add_request([5, 6, 7], GREEDY, request_id="a")
    with pytest.raises(ValueError) as err:
        engine.add_request([8, 9], GREEDY, request_id="a")
    assert str(err.value) == "request id 'a' is already in use"
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_classification([8, 9], ["x", "y"], [[10], [11]], request_id="a")
    outs = run_all(engine)
    assert list(outs) == ["a"] and outs["a"].prompt_token_ids == [5, 6, 7]
    engine.add_request([8, 9], GREEDY, request_id="a")  # free again once finished
    run_all(engine)
    assert_idle(engine)


def test_generate_validates_every_request_before_queueing_any(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="logprobs=21 is more than max_logprobs=20"):
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY, SamplingParams(logprobs=21)])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6, 7], []], GREEDY)
    assert not engine.has_unfinished()
    assert engine.scheduler.waiting == type(engine.scheduler.waiting)()
    llm.encode_labels = lambda labs, texts=None: [[10], [11, 12]]  # no tokenizer in this tiny model
    try:
        with pytest.raises(ValueError, match="prompt plus label has 257 tokens"):
            llm.classify([[5, 6, 7], [3] * 255], ["x", "y"])
    finally:
        del llm.encode_labels
    assert not engine.has_unfinished()


def test_a_request_past_its_deadline_is_not_lost_by_a_failed_step(tiny_llama_dir):
    import time

    engine = make_llm(tiny_llama_dir).llm_engine
    engine.add_request([5, 6, 7], GREEDY, request_id="late", timeout_s=0.01)
    engine.add_request([8, 9], GREEDY, request_id="other")
    time.sleep(0.05)
    fail_next_execute(engine)
    with pytest.raises(EngineStepError) as err:
        engine.step()
    outs = run_all(engine)
    # every request either ends with the step's error or returns an output; none is dropped
    assert sorted(err.value.request_ids + list(outs)) == ["late", "other"]
    assert_idle(engine)
    assert engine._requests == {} and engine._owners == {}
