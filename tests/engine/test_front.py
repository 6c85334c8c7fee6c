"""EngineFront: many threads feeding one engine step loop."""

import threading

import pytest

from weir.engine import EngineFront, LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_num_seqs=4)


def test_many_threads_get_the_same_tokens_as_one_batch(llm):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(12)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    front = EngineFront(llm)
    got = [None] * len(prompts)

    def worker(i):
        got[i] = front.submit_generate(prompts[i], GREEDY).result(timeout=60).outputs[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    front.shutdown(drain=True)
    assert got == want
    pool = llm.llm_engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_bad_request_fails_its_future_only(llm):
    front = EngineFront(llm)
    with pytest.raises(ValueError, match="prompt is empty"):
        front.submit_generate([], GREEDY)
    ok = front.submit_generate([5, 6, 7], GREEDY)
    assert len(ok.result(timeout=60).outputs[0].token_ids) == 6
    front.shutdown()


def test_shutdown_drains_submitted_work_and_refuses_new(llm):
    front = EngineFront(llm)
    futs = [front.submit_generate([9, 9, i + 3], GREEDY) for i in range(6)]
    front.shutdown(drain=True)
    assert all(len(f.result(timeout=0).outputs[0].token_ids) == 6 for f in futs)
    with pytest.raises(RuntimeError, match="shutting down"):
        front.submit_generate([5], GREEDY)


def test_abort_frees_blocks(llm):
    front = EngineFront(llm)
    fut = front.submit_generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    front.abort(fut)
    front.shutdown(drain=True)
    assert fut.cancelled()
    pool = llm.llm_engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_calibrated_classify_matches_offline_and_reuses_the_prior(llm):
    from weir.engine.outputs import calibrate

    eng = llm.llm_engine
    labels = ["x", "y", "z"]
    label_ids = [[10, 11], [12], [13, 14, 15]]
    llm.processor.encode_labels = lambda labs, texts=None: label_ids  # no tokenizer in this tiny model
    try:
        def run(prompt):
            rid = eng.add_classification(prompt, labels, label_ids)
            return llm._run([rid])[0]

        prior, raw = run([4, 4, 4]), run([7, 8, 9, 10])
        want = calibrate(raw, prior)
        assert want.logprobs == {lab: raw.logprobs[lab] - prior.logprobs[lab] for lab in labels}
        front = EngineFront(llm)
        got = [front.submit_classify([7, 8, 9, 10], labels, calibration_prompt=[4, 4, 4]).result(timeout=60)
               for _ in range(2)]
        assert len(front._priors) == 1
        front.shutdown()
    finally:
        del llm.processor.encode_labels
    for g in got:
        assert g.label == want.label
        assert g.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert sum(g.probs.values()) == pytest.approx(1.0)


@pytest.fixture(params=["thread", "process"])
def one_seq_front(request, tiny_llama_dir):
    """A front whose engine runs one request at a time: the step loop on a thread of this
    process (EngineFront), or the engine core in a process of its own (EngineCoreClient)."""
    from weir.engine.core_client import EngineCoreClient

    args = dict(model=tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_num_seqs=1,
                max_model_len=256)
    front = EngineFront(LLM(**args)) if request.param == "thread" else EngineCoreClient(args)
    yield front
    front.shutdown(drain=False)


def test_started_at_is_stamped_when_the_engine_first_schedules_a_request_not_when_it_is_queued(one_seq_front):
    import time

    from weir.engine.front import deadline

    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    first = one_seq_front.submit_generate([5, 6, 7], long)
    first_done = []
    first.add_done_callback(lambda _: first_done.append(time.monotonic()))
    second = one_seq_front.submit_generate([8, 9], GREEDY)  # waits for first's place in the engine
    second.result(timeout=60)
    assert first_done and first.started_at is not None
    assert first.started_at < first_done[0] <= second.started_at  # queued behind first: not started
    assert deadline(second, 2.5) == second.started_at + 2.5


def test_result_after_start_does_not_count_the_wait_in_the_engines_queue():
    import threading
    import time
    from concurrent.futures import Future, TimeoutError as FutureTimeout

    from weir.engine.front import result_after_start

    queued = Future()
    queued.started_at = None
    threading.Timer(0.6, queued.set_result, args=("done",)).start()  # never scheduled within 0.2 s
    assert result_after_start(queued, 0.2, poll_s=0.05) == "done"

    running = Future()
    running.started_at = None
    start = time.monotonic() + 0.1
    threading.Timer(0.1, setattr, args=(running, "started_at", start)).start()
    with pytest.raises(FutureTimeout):
        result_after_start(running, 0.3, poll_s=0.05)
    assert time.monotonic() >= start + 0.3  # 0.3 s from its start, not from the call


def test_a_calibrated_classification_has_the_start_of_its_own_request(llm):
    from weir.engine.front import deadline

    llm.processor.encode_labels = lambda labs, texts=None: [[10, 11], [12]]  # no tokenizer in this tiny model
    try:
        front = EngineFront(llm)
        out = front.submit_classify([7, 8, 9, 10], ["x", "y"], calibration_prompt=[4, 4, 4])
        out.result(timeout=60)
        front.shutdown()
    finally:
        del llm.processor.encode_labels
    assert out.request_future.started_at is not None
    assert deadline(out, 3.0) == out.request_future.started_at + 3.0  # else a wait for it never times out
