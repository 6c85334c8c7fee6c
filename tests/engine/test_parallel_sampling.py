"""ParentRequest: n samples forked from the first one's prompt blocks."""

from weir.engine.block_pool import BlockPool
from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.parallel_sampling import ParentRequest
from weir.engine.request import Request, RequestStatus
from weir.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(n=3, temperature=1.0, seed=0)


def sequence(rid, index):
    return Request(rid, list(range(3, 9)), PARAMS, sample_index=index)


def test_children_share_full_prompt_blocks_and_copy_the_partial_one():
    copies = []
    kv = KVCacheManager(BlockPool(8), 4, lambda src, dst: copies.append((src, dst)))
    first = sequence("r", 0)
    parent = ParentRequest("r", 3, first)
    assert kv.allocate_slots(first, 6)
    first.num_computed_tokens = 6
    assert not parent.needs_children(first)  # no token sampled yet
    first.append_output_token(42)
    assert parent.needs_children(first)
    children = parent.fork_children(sequence, kv)
    assert [c.request_id for c in children] == ["r/1", "r/2"]
    assert [c.sample_index for c in children] == [1, 2]
    # 5 prompt tokens taken (the last one is recomputed by each child to sample its own token)
    assert [c.block_table for c in children] == [[0, 2], [0, 3]]
    assert [c.num_computed_tokens for c in children] == [5, 5]
    assert copies == [(1, 2), (1, 3)]
    assert kv.pool.blocks[0].ref_cnt == 3 and kv.pool.blocks[1].ref_cnt == 1
    assert parent.sequences == [first] + children and not parent.needs_children(first)
    assert parent.sequence_ids() == ["r", "r/1", "r/2"]
    for s in parent.sequences:
        assert not parent.is_finished
        s.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert parent.is_finished


def test_first_sequence_aborted_before_the_fork_ends_the_request_alone():
    first = sequence("r", 0)
    parent = ParentRequest("r", 3, first)
    first.status = RequestStatus.FINISHED_ABORTED
    assert not parent.is_finished
    parent.sequence_ended(first)
    assert parent.n == 1 and parent.is_finished


def test_a_child_without_a_block_for_its_copy_recomputes():
    kv = KVCacheManager(BlockPool(2), 4, lambda src, dst: None)
    first = sequence("r", 0)
    parent = ParentRequest("r", 2, first)
    assert kv.allocate_slots(first, 6)
    first.num_computed_tokens = 6
    first.append_output_token(42)
    (child,) = parent.fork_children(sequence, kv)
    assert child.num_computed_tokens == 0 and child.block_table == []
