from weir.engine.block_pool import BlockPool
from weir.engine.kv_cache_manager import KVCacheManager
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
