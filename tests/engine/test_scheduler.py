"""Scheduler on tiny block pools: exact token budgets, preemption victims and freed block ids."""

from weir.engine.block_pool import BlockPool
from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.request import Request, RequestStatus
from weir.engine.sampling_params import SamplingParams
from weir.engine.scheduler import ModelRunnerOutput, Scheduler


def make(num_blocks=4, block_size=4, max_num_seqs=4, budget=64, caching=False):
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size, lambda src, dst: None)
    return Scheduler(kv, max_num_seqs, budget, max_model_len=64)


def req(rid, num_tokens, max_tokens=16):
    return Request(rid, list(range(3, 3 + num_tokens)), SamplingParams(temperature=0, max_tokens=max_tokens))


def plan(sched):
    return [(s.request.request_id, s.num_new_tokens) for s in sched.scheduled]


def step(scheduler, token=7):
    """Schedule, then update as if every request that completed its tokens sampled ``token``."""
    sched = scheduler.schedule()
    sampled = {s.request.request_id: token for s in sched.scheduled if s.completes_prompt}
    return sched, scheduler.update(sched, ModelRunnerOutput(sampled=sampled))


def test_token_budget_is_split_in_arrival_order_then_prefill_is_chunked():
    s = make(num_blocks=8, budget=10)
    a, b, c = req("a", 6), req("b", 7), req("c", 3)
    for r in (a, b, c):
        s.add_request(r)
    sched, update = step(s)
    assert plan(sched) == [("a", 6), ("b", 4)]  # c waits: the budget is spent
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert [r.request_id for r in update.sampled] == ["a"] and update.finished == []
    sched, _ = step(s)
    # running first (a's decode, b's last 3 prompt tokens), then c from the waiting queue
    assert plan(sched) == [("a", 1), ("b", 3), ("c", 3)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4])


def test_max_num_seqs_caps_the_running_requests():
    s = make(num_blocks=8, max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2))
    sched, _ = step(s)
    assert plan(sched) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_out_of_blocks_preempts_the_most_recently_admitted():
    s = make(num_blocks=4)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    # every request's fifth token needs a second block; one is free
    sched, _ = step(s)
    assert plan(sched) == [("a", 1), ("b", 1)]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])  # b got c's freed block
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["c"] and s.running == [a, b]
    assert c.all_token_ids == list(range(3, 7)) + [7]  # its sampled token stays, to be recomputed


def test_a_request_that_cannot_fit_preempts_itself_last():
    s = make(num_blocks=2)
    a, b = req("a", 4), req("b", 4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert (a.block_table, b.block_table) == ([0], [1])
    sched, _ = step(s)  # a needs a block: b is preempted; then b is not scheduled at all
    assert plan(sched) == [("a", 1)]
    assert a.block_table == [0, 1] and s.running == [a] and list(s.waiting) == [b]


def test_finished_requests_hold_their_blocks_until_freed_then_free_tail_first():
    s = make(num_blocks=4)
    a = req("a", 7, max_tokens=1)
    s.add_request(a)
    sched, update = step(s)
    assert update.finished == [a] and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.running == [] and a.block_table == [0, 1]  # still held: forks may share them
    s.free(update.finished)
    assert list(s.kv.pool.free_queue) == [2, 3, 1, 0]  # the chain's tail is evicted first
    assert a.block_table == [] and not s.has_unfinished()


def test_failed_step_forgets_only_the_hashes_registered_for_it():
    s = make(num_blocks=8, caching=True)
    a = req("a", 9)  # two full blocks
    s.add_request(a)
    step(s)  # committed: blocks 0 and 1 hold a's first 8 tokens
    pool = s.kv.pool
    assert sorted(b.block_id for b in pool.cached.values()) == [0, 1]
    b = Request("b", a.prompt_token_ids[:8] + list(range(100, 108)) + [9], SamplingParams(temperature=0))
    s.add_request(b)
    sched = s.schedule()
    assert plan(sched) == [("a", 1), ("b", 9)]  # b hit a's two blocks
    assert b.block_table == [0, 1, 3, 4, 5] and sorted(x.block_id for x in pool.cached.values()) == [0, 1, 3, 4]
    assert s.fail_step(sched) == [a, b]
    assert sorted(x.block_id for x in pool.cached.values()) == [0, 1]
    assert [x.block_hash is None for x in pool.blocks[2:6]] == [True] * 4
