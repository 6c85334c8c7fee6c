"""The step builder: packed order, vLLM's field names, CUDA-graph padding and the graph-input
copies, with exact values (block size 4)."""


import pytest
import torch

from weir.engine.cuda_graphs import DecodeGraphs
from weir.engine.scheduler import ScheduledRequest, SchedulerOutput
from weir.engine.step_inputs import build_step_inputs
from tests.engine.steps import Req, mixed_step

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def as_lists(inputs):
    return {f: getattr(inputs, f).tolist() for f in
            ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mixed_step_packs_decodes_then_prefix_chunks_shortest_first_then_fresh_prompts(dtype, device):
    sched = mixed_step()
    inputs = build_step_inputs(sched, 4, device, dtype)
    # packed order: A (decode), D (chunk of 2), C (chunk of 4), B (fresh)
    assert [s.request for s in inputs.requests] == [sched.scheduled[i].request for i in (2, 3, 1, 0)]
    assert as_lists(inputs) == {
        "input_ids": [15, 42, 43, 34, 35, 36, 37, 20, 21, 22],
        "positions": [5, 2, 3, 4, 5, 6, 7, 0, 1, 2],
        "slot_mapping": [9, 26, 27, 4, 5, 6, 7, 12, 13, 14],
        "query_start_loc": [0, 1, 3, 7, 10],
        "seq_lens": [6, 4, 8, 3],
        "block_table": [[7, 2], [6, 0], [5, 1], [3, 0]],
    }
    assert (inputs.num_decodes, inputs.max_query_len, inputs.max_seq_len, inputs.num_actual_tokens) == (1, 4, 8, 10)
    assert (inputs.query_start_loc_cpu, inputs.seq_lens_cpu) == ([0, 1, 3, 7, 10], [6, 4, 8, 3])
    assert {(getattr(inputs, f).dtype, getattr(inputs, f).device) for f in as_lists(inputs)} == {(dtype, device)}
    # every per-token and per-request field is a view of one packed tensor (one host-to-device
    # copy); the block table is gathered from the persistent rows into a tensor of its own
    base = inputs.input_ids.untyped_storage().data_ptr()
    packed = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens")
    assert all(getattr(inputs, f).untyped_storage().data_ptr() == base for f in packed)
    assert inputs.block_table.untyped_storage().data_ptr() != base


def test_decode_step_padded_for_a_graph_batch():
    a = Req(list(range(10, 16)), [7, 2], 5)
    e = Req([50, 51, 52], [4], 2)
    inputs = build_step_inputs(SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(e, 1)]), 4, CPU,
                               torch.int32, num_padded_decodes=4)
    assert as_lists(inputs) == {
        "input_ids": [15, 52, 0, 0],
        "positions": [5, 2, 0, 0],
        "slot_mapping": [9, 18, -1, -1],
        "query_start_loc": [0, 1, 2, 3, 4],
        "seq_lens": [6, 3, 0, 0],
        "block_table": [[7, 2], [4, 0], [0, 0], [0, 0]],
    }
    assert (inputs.num_decodes, inputs.num_reqs, inputs.num_actual_tokens, len(inputs.requests)) == (4, 4, 2, 2)
    with pytest.raises(ValueError, match="cannot pad"):
        build_step_inputs(mixed_step(), 4, CPU, torch.int32, num_padded_decodes=8)


def test_profiling_step_writes_no_slot():
    inputs = build_step_inputs(mixed_step(), 4, CPU, torch.int64, write_kv=False)
    assert inputs.slot_mapping.tolist() == [-1] * 10
    assert inputs.num_actual_tokens == 0


def test_graph_static_inputs_take_the_padded_step_and_keep_padding_rows_inert():
    graphs = DecodeGraphs(None, _Int32Backend(), None, 4, 3, 4, CPU, capture=False)
    static = graphs.static_inputs
    assert as_lists(static) == {
        "input_ids": [0] * 4, "positions": [0] * 4, "slot_mapping": [-1] * 4,
        "query_start_loc": [0, 1, 2, 3, 4], "seq_lens": [0] * 4, "block_table": [[0, 0, 0]] * 4,
    }
    a = Req(list(range(10, 16)), [7, 2], 5)
    e = Req([50, 51, 52], [4], 2)
    two = build_step_inputs(SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(e, 1)]), 4, CPU,
                            torch.int32, num_padded_decodes=4)
    assert graphs.copy_inputs(two) == 4
    assert as_lists(static.decode_rows(4)) == {
        "input_ids": [15, 52, 0, 0], "positions": [5, 2, 0, 0], "slot_mapping": [9, 18, -1, -1],
        "query_start_loc": [0, 1, 2, 3, 4], "seq_lens": [6, 3, 0, 0],
        "block_table": [[7, 2, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]],
    }
    # a one-decode step then replays the 1-row graph: rows past it keep stale values never read
    one = build_step_inputs(SchedulerOutput([ScheduledRequest(e, 1)]), 4, CPU, torch.int32, num_padded_decodes=1)
    assert graphs.copy_inputs(one) == 1
    assert as_lists(static.decode_rows(1)) == {
        "input_ids": [52], "positions": [2], "slot_mapping": [18], "query_start_loc": [0, 1],
        "seq_lens": [3], "block_table": [[4, 2, 0]],
    }
    with pytest.raises(ValueError, match="no decode graph"):
        graphs.copy_inputs(build_step_inputs(SchedulerOutput([ScheduledRequest(e, 1)]), 4, CPU, torch.int32,
                                             num_padded_decodes=3))


class _Int32Backend:
    index_dtype = torch.int32
