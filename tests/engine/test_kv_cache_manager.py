from weir.engine.block_pool import BlockPool
from weir.engine.block_pool import NULL_BLOCK_ID
from weir.engine.kv_cache_manager import KVCacheManager, freeable_window
from weir.engine.request import Request
from weir.engine.sampling_params import SamplingParams


def make(num_blocks=8, bs=4, caching=True):
    copies = []
    kv = KVCacheManager(BlockPool(num_blocks, caching), bs, lambda s, d: copies.append((s, d)))
    return kv, copies


def req(rid, ids):
    return Request(rid, ids, SamplingParams(temperature=0))


def test_block_table_covers_exactly_the_tokens():
    kv, _ = make()
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert r.block_table == [0, 1, 2]  # ceil(10 / 4)
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1)  # token 11 fits in block 2
    assert r.block_table == [0, 1, 2]
    r.num_computed_tokens = 11
    r.append_output_token(5)
    r.append_output_token(6)
    assert kv.allocate_slots(r, 2)  # tokens 12, 13 -> a fourth block
    assert r.block_table == [0, 1, 2, 3]
    kv.free(r)
    assert kv.pool.num_free_blocks == 8 and r.block_table == []


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token():
    kv, _ = make()
    a = req("a", list(range(8)))  # exactly two full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 8)
    b = req("b", list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    # the second block is cached too, but the last token must be recomputed for logits
    assert [h.block_id for h in hits] == [0] and n == 4
    c = req("c", list(range(9)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.num_hit_tokens == 12 and kv.num_queries_tokens == 8 + 8 + 9


def test_allocation_failure_changes_nothing():
    kv, _ = make(num_blocks=2)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert r.block_table == [] and kv.pool.num_free_blocks == 2


def test_fork_shares_full_blocks_and_copies_partial():
    kv, copies = make()
    parent = req("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = req("c", list(range(6)) + [40, 41])
    assert kv.fork(parent, child)
    assert child.block_table == [0, 2] and copies == [(1, 2)]
    assert child.num_computed_tokens == 6
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[1].ref_cnt == 1
    kv.free(parent)
    kv.free(child)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks) and kv.pool.num_free_blocks == 8


# ---- sliding windows: every layer has one, the largest is 6 (block size 4) ----------------------

def make_windowed(num_blocks=8, window=6):
    copies = []
    kv = KVCacheManager(BlockPool(num_blocks, True), 4, lambda s, d: copies.append((s, d)), sliding_window=window)
    return kv, copies


def step(kv, r, num_new):
    """Schedule ``num_new`` tokens of ``r`` and mark them computed (a decode appends a token)."""
    assert kv.allocate_slots(r, num_new)
    r.num_computed_tokens += num_new
    if r.num_computed_tokens == r.num_tokens:
        r.append_output_token(99)


def test_blocks_leave_as_the_window_slides_earliest_first():
    kv, _ = make_windowed()
    r = req("a", list(range(10)))
    step(kv, r, 10)
    assert r.block_table == [0, 1, 2] and kv.pool.num_free_blocks == 5
    # next query at position 10 sees 5..10: block 0 (positions 0-3) is never read again
    step(kv, r, 1)
    assert r.block_table == [NULL_BLOCK_ID, 1, 2] and kv.pool.num_free_blocks == 6
    assert kv.req_blocks["a"][0] is None and kv.pool.blocks[0].ref_cnt == 0
    step(kv, r, 1)  # position 11 sees 6..11: block 1 still needed
    step(kv, r, 1)  # position 12 sees 7..12: a fourth block, taken from the free queue's head
    assert r.block_table == [NULL_BLOCK_ID, 1, 2, 3]
    step(kv, r, 1)  # position 13 sees 8..13: block 1 leaves
    assert r.block_table == [NULL_BLOCK_ID, NULL_BLOCK_ID, 2, 3]
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 0, 1]
    kv.free(r)
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 0, 1, 3, 2] and r.block_table == []


def test_a_model_with_a_global_layer_frees_nothing_early():
    assert freeable_window([16, None, 16]) is None and freeable_window([]) is None
    assert freeable_window([16, 32, 16]) == 32
    kv, _ = make()  # sliding_window None
    r = req("a", list(range(10)))
    for n in (10, 1, 1, 1, 1):
        step(kv, r, n)
    assert r.block_table == [0, 1, 2, 3]


def test_a_prefix_hit_needs_only_the_blocks_its_window_reaches():
    kv, _ = make_windowed()
    a = req("a", list(range(20)))
    step(kv, a, 20)
    step(kv, a, 1)  # position 20 sees 15..20: blocks 0-2 freed, still cached
    assert a.block_table == [NULL_BLOCK_ID] * 3 + [3, 4, 5]
    other = req("x", list(range(100, 112)))
    step(kv, other, 12)  # takes blocks 6, 7 and 0: block 0's hash is forgotten
    assert other.block_table == [6, 7, 0] and kv.pool.get_cached_block(a.block_hashes[0]) is None
    # a prompt of a's first 16 tokens and one more: its query at 16 sees 11..16, blocks 2 and 3
    c = req("c", list(range(17)))
    hits, n = kv.get_computed_blocks(c)
    assert [None if h is None else h.block_id for h in hits] == [None, None, 2, 3] and n == 16
    assert kv.allocate_slots(c, 1, hits)
    assert c.block_table == [NULL_BLOCK_ID, NULL_BLOCK_ID, 2, 3, 1]  # block 1: the queue's head
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 2]
    # without a window the same cache hits nothing: the chain's first block is gone
    kv.sliding_window = None
    assert kv.get_computed_blocks(req("d", list(range(17)))) == ([], 0)


def test_a_prefix_hit_stops_before_a_window_with_an_evicted_block():
    kv, _ = make_windowed()
    a = req("a", list(range(16)))
    step(kv, a, 16)
    kv.free(a)  # blocks 3, 2, 1, 0 join the queue in that order, cached
    b = req("b", list(range(100, 104)))
    step(kv, b, 4)  # takes block 4 (the queue's head); then
    x = req("x", list(range(200, 216)))
    step(kv, x, 16)  # 5, 6, 7 and block 3: a's fourth block is gone
    hits, n = kv.get_computed_blocks(req("c", list(range(16)) + [1]))
    # 4 blocks would need blocks 2 and 3; 3 blocks (query at 12 sees 7..12) need blocks 1 and 2
    assert [None if h is None else h.block_id for h in hits] == [None, 1, 2] and n == 12


def test_a_prefix_hit_needs_every_block_its_window_reaches():
    kv, _ = make_windowed()
    a = req("a", list(range(16)))
    step(kv, a, 16)
    kv.free(a)
    kv.pool.uncache_blocks([kv.pool.blocks[2]])  # as if evicted
    hits, n = kv.get_computed_blocks(req("c", list(range(16)) + [1]))
    # 4 blocks would need blocks 2 and 3, 3 blocks 1 and 2; 2 blocks need 0 and 1
    assert [h.block_id for h in hits] == [0, 1] and n == 8


def test_fork_takes_only_the_window_and_refuses_freed_blocks():
    kv, copies = make_windowed()
    parent = req("p", list(range(14)))
    step(kv, parent, 14)
    step(kv, parent, 1)  # position 14 sees 9..14: blocks 0, 1 freed
    assert parent.block_table == [NULL_BLOCK_ID, NULL_BLOCK_ID, 2, 3]
    child = req("c", list(range(14)) + [7])
    assert kv.fork(parent, child, 14)
    assert child.block_table == [NULL_BLOCK_ID, NULL_BLOCK_ID, 2, 4] and copies == [(3, 4)]
    late = req("l", list(range(8)) + [7])
    assert not kv.fork(parent, late, 8)  # its query at 8 would need the freed blocks 0, 1
    assert late.block_table == [] and kv.pool.blocks[2].ref_cnt == 2
