"""Scheduler on tiny block pools: exact token budgets, preemption victims and freed block ids."""

import pytest

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


def preq(rid, num_tokens, priority, arrival, max_tokens=16):
    r = Request(rid, list(range(3, 3 + num_tokens)), SamplingParams(temperature=0, max_tokens=max_tokens),
                arrival_time=arrival, priority=priority)
    return r


def make_priority(num_blocks=4, block_size=4, max_num_seqs=4, budget=64, strict_priority=False):
    kv = KVCacheManager(BlockPool(num_blocks, False), block_size, lambda src, dst: None)
    return Scheduler(kv, max_num_seqs, budget, max_model_len=64, policy="priority",
                     strict_priority=strict_priority)


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    s = make_priority(num_blocks=16, max_num_seqs=3)
    for rid, priority, arrival in [("a", 5, 1.0), ("b", 0, 4.0), ("c", 5, 2.0), ("d", 1, 3.0), ("e", 0, 5.0)]:
        s.add_request(preq(rid, 2, priority, arrival))
    assert [r.request_id for r in s.waiting] == ["b", "e", "d", "a", "c"]
    sched, _ = step(s)
    assert plan(sched) == [("b", 2), ("e", 2), ("d", 2)]
    assert [r.request_id for r in s.waiting] == ["a", "c"]


def test_a_higher_priority_arrival_preempts_the_lowest_running_one():
    s = make_priority(num_blocks=16, max_num_seqs=2)
    bulk = [preq("bulk-1", 4, 10, 1.0), preq("bulk-2", 4, 10, 2.0)]
    for r in bulk:
        s.add_request(r)
    step(s)
    assert [r.request_id for r in s.running] == ["bulk-1", "bulk-2"]
    s.add_request(preq("interactive", 4, 0, 3.0))
    sched, _ = step(s)
    # every slot was taken: the last bulk request (lowest priority, latest arrival) made room
    assert plan(sched) == [("bulk-1", 1), ("interactive", 4)]
    assert (bulk[1].status, bulk[1].num_computed_tokens, bulk[1].num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in s.waiting] == ["bulk-2"] and s.num_preemptions == 1
    # an equal priority never preempts
    s.add_request(preq("bulk-3", 4, 10, 4.0))
    sched, _ = step(s)
    assert plan(sched) == [("interactive", 1), ("bulk-1", 1)]
    assert [r.request_id for r in s.waiting] == ["bulk-2", "bulk-3"] and s.num_preemptions == 1


def test_out_of_blocks_under_priority_preempts_the_lowest_priority_not_the_latest():
    s = make_priority(num_blocks=3, max_num_seqs=4)
    low, high = preq("low", 4, 9, 1.0), preq("high", 4, 0, 2.0)
    s.add_request(low)
    step(s)
    s.add_request(high)
    step(s)
    assert (low.block_table, high.block_table) == ([0, 1], [2])
    # high's decode needs a block: low (priority 9) goes, though high arrived later
    sched, _ = step(s)
    assert plan(sched) == [("high", 1)]
    assert low.status == RequestStatus.PREEMPTED and [r.request_id for r in s.waiting] == ["low"]


def test_strict_priority_holds_worse_priorities_with_their_blocks_until_the_better_ones_end():
    s = make_priority(num_blocks=16, max_num_seqs=4, strict_priority=True)
    bulk = [preq("bulk-1", 4, 9, 1.0), preq("bulk-2", 4, 9, 2.0)]
    for r in bulk:
        s.add_request(r)
    step(s)
    assert [r.request_id for r in s.running] == ["bulk-1", "bulk-2"]
    held_tables = [list(r.block_table) for r in bulk]
    s.add_request(preq("interactive", 4, 0, 3.0, max_tokens=2))
    s.add_request(preq("bulk-3", 4, 9, 4.0))
    sched, _ = step(s)
    # free slots: nothing preempted, but the bulk requests are not stepped (nor bulk-3 admitted)
    assert plan(sched) == [("interactive", 4)]
    assert sorted(r.request_id for r in s.running) == ["bulk-1", "bulk-2", "interactive"]
    assert [list(r.block_table) for r in bulk] == held_tables and [r.num_computed_tokens for r in bulk] == [4, 4]
    assert s.num_preemptions == 0 and [r.request_id for r in s.waiting] == ["bulk-3"]
    sched, update = step(s)
    assert plan(sched) == [("interactive", 1)] and [r.request_id for r in update.finished] == ["interactive"]
    s.free(update.finished)
    # the better one is done: the held ones resume where they were, bulk-3 is admitted
    sched, _ = step(s)
    assert plan(sched) == [("bulk-1", 1), ("bulk-2", 1), ("bulk-3", 4)]
    assert [r.num_preemptions for r in bulk] == [0, 0]


def test_without_strict_priority_every_running_request_shares_the_step():
    s = make_priority(num_blocks=16, max_num_seqs=3)
    for r in [preq("bulk-1", 4, 9, 1.0), preq("bulk-2", 4, 9, 2.0)]:
        s.add_request(r)
    step(s)
    s.add_request(preq("interactive", 4, 0, 3.0))
    sched, _ = step(s)
    assert plan(sched) == [("bulk-1", 1), ("bulk-2", 1), ("interactive", 4)]
    sched, _ = step(s)
    assert plan(sched) == [("interactive", 1), ("bulk-1", 1), ("bulk-2", 1)]


def test_strict_priority_needs_the_priority_policy():
    kv = KVCacheManager(BlockPool(4, False), 4, lambda src, dst: None)
    with pytest.raises(ValueError, match="strict_priority=True needs scheduling_policy='priority'"):
        Scheduler(kv, 4, 64, max_model_len=64, strict_priority=True)



def test_take_first_scheduled_lists_each_request_once_at_its_first_scheduling():
    s = make(num_blocks=3, max_num_seqs=2)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    for r in (a, b, c):
        s.add_request(r)
    assert s.take_first_scheduled() == []  # queued is not started
    step(s)  # a and b run (max_num_seqs 2)
    assert s.take_first_scheduled() == ["a", "b"]
    assert s.take_first_scheduled() == []  # taken
    s.abort("a")  # its place and block free
    step(s)  # c takes a's place
    assert s.take_first_scheduled() == ["c"]
    step(s)  # c's sixth token needs a second block, none is free: c, the latest admitted, is preempted
    assert c.status == RequestStatus.PREEMPTED
    s.abort("b")
    step(s)
    assert c.status == RequestStatus.RUNNING
    assert s.take_first_scheduled() == []  # scheduled again after a preemption: not a first start
