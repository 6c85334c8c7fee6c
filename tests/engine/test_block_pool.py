import pytest

from weir.engine.block_pool import BlockPool, hash_block_tokens


def test_new_blocks_come_from_head_in_id_order():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)


def test_freed_blocks_keep_hash_and_evict_lru_tail_first():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    h1 = hash_block_tokens(None, (1, 2))
    h2 = hash_block_tokens(h1, (3, 4))
    pool.cache_full_block(a, h1)
    pool.cache_full_block(b, h2)
    pool.free_blocks([c, b, a])  # a request frees its chain reversed
    assert list(pool.free_queue) == [3, 2, 1, 0]
    assert pool.get_cached_block(h1) is a and pool.get_cached_block(h2) is b
    # two new blocks: 3 then 2; the chain's tail (1) is next, its head (0) last
    assert [x.block_id for x in pool.get_new_blocks(3)] == [3, 2, 1]
    assert pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is a


def test_hit_on_free_block_takes_it_out_of_free_queue():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, (7,))
    pool.cache_full_block(a, h)
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and 0 in pool.free_queue
    pool.touch([pool.get_cached_block(h)])
    assert a.ref_cnt == 1 and 0 not in pool.free_queue
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2


def test_chain_hash_depends_on_parent_and_extra_key():
    h1 = hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(h1, (3, 4)) == hash_block_tokens(hash_block_tokens(None, (1, 2)), (3, 4))
    assert hash_block_tokens(h1, (3, 4)) != hash_block_tokens(hash_block_tokens(None, (9, 2)), (3, 4))
    assert hash_block_tokens(None, (1, 2), "model-a") != hash_block_tokens(None, (1, 2), "model-b")


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, (1,))
    pool.cache_full_block(a, h)
    assert pool.get_cached_block(h) is None


def test_ref_count_never_negative():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="negative"):
        pool.free_blocks([a])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, (1,))
    pool.cache_full_block(a, h)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and a.block_hash is None
