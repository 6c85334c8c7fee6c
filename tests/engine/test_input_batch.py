"""The persistent batch against the list-based step builder it replaced, over a real scheduler
run (chunked prefill, prefix hits, forks, preemption, finishing, CUDA-graph padding), and the
row bookkeeping: reuse after a finish, rebuild after a preemption, only new ids appended, only
changed rows copied, prefix-cache work per step independent of the context."""

import torch

from weir.engine.block_pool import BlockPool
from weir.engine.input_batch import BlockTable, InputBatch
from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.request import Request
from weir.engine.sampling_params import SamplingParams
from weir.engine.scheduler import ModelRunnerOutput, ScheduledRequest, Scheduler, SchedulerOutput
from weir.engine.step_inputs import build_step_inputs, packed_order
from tests.engine.test_step_inputs import CPU, as_lists

BS = 4


def reference_inputs(sched: SchedulerOutput, num_padded_decodes=None, block_table_width=None) -> dict:
    """The step's fields as the list-based builder made them: every request's whole block table
    flattened, each token's slot looked up in Python."""
    ids, pos, slots, starts, seq_lens, tables = [], [], [], [0], [], []
    for s in packed_order(sched):
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        ids += r.all_token_ids[start:end]
        pos += range(start, end)
        slots += [r.block_table[p // BS] * BS + p % BS for p in range(start, end)]
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
        tables.append(list(r.block_table))
    pad = (num_padded_decodes or len(tables)) - len(tables)
    ids, pos, slots, seq_lens = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad, seq_lens + [0] * pad
    starts += range(starts[-1] + 1, starts[-1] + pad + 1)
    tables += [[]] * pad
    width = max(max(map(len, tables), default=0), block_table_width or 0, 1)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "query_start_loc": starts,
            "seq_lens": seq_lens, "block_table": [t + [0] * (width - len(t)) for t in tables]}


def request(rid, prompt, max_tokens):
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_persistent_batch_matches_the_list_builder_over_a_scheduler_run():
    kv = KVCacheManager(BlockPool(13), BS, lambda src, dst: None)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=48)
    batch = InputBatch(1, 1, CPU)  # grows in both dimensions as the run needs
    shared = list(range(3, 12))  # 9 tokens: two full blocks that later prompts hit
    arrivals = {0: [request("a", shared + [50], 12), request("b", list(range(60, 73)), 6)],
                3: [request("c", shared + [51, 52], 20), request("d", list(range(80, 87)), 18)],
                9: [request("e", shared[:8] + [53] * 9, 9)], 14: [request("f", shared + [54], 25)]}
    seen = {"chunk over prefix": 0, "padded": 0, "forks": 0, "finished": 0}
    holders: dict[int, set[str]] = {}  # row -> the requests that held it
    for step in range(60):
        for r in arrivals.get(step, []):
            s.add_request(r)
        sched = s.schedule()
        if not sched.scheduled:
            if s.waiting:
                s.release_waiting_blocks()
            continue
        got = build_step_inputs(sched, BS, CPU, torch.int64, input_batch=batch)
        assert as_lists(got) == reference_inputs(sched), f"step {step}"
        if all(x.num_new_tokens == 1 for x in sched.scheduled):  # the CUDA-graph build of the step
            padded = build_step_inputs(sched, BS, CPU, torch.int32, num_padded_decodes=8, block_table_width=13,
                                       input_batch=batch)
            assert as_lists(padded) == reference_inputs(sched, 8, 13), f"step {step}"
            seen["padded"] += 1
        seen["chunk over prefix"] += any(x.num_new_tokens > 1 and x.request.num_computed_tokens
                                         for x in sched.scheduled)
        for x in sched.scheduled:
            holders.setdefault(batch.row_of(x.request), set()).add(x.request.request_id)
        sampled = {x.request.request_id: 7 + step % 5 for x in sched.scheduled if x.completes_prompt}
        update = s.update(sched, ModelRunnerOutput(sampled=sampled))
        for parent in update.sampled:
            if parent.request_id in ("a", "c") and len(parent.output_token_ids) == 1:  # n = 2: fork a sample
                child = request(parent.request_id + "/1", parent.prompt_token_ids, 5)
                if kv.fork(parent, child, parent.num_prompt_tokens - 1):
                    seen["forks"] += 1
                s.add_request(child, front=True)
        seen["finished"] += len(update.finished)
        s.free(update.finished)
    assert not s.has_unfinished()
    assert s.num_preemptions > 0 and kv.num_hit_tokens > 0
    assert all(seen.values()) and any(len(h) > 1 for h in holders.values()), (seen, holders)


def test_a_finished_requests_row_is_reused_by_the_next_new_request():
    kv = KVCacheManager(BlockPool(16), BS, lambda src, dst: None)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32)
    batch = InputBatch(2, 8, CPU)
    a, b, c = request("a", [1, 2, 3], 1), request("b", [4, 5, 6, 7, 8], 3), request("c", [9] * 6, 2)
    for r in (a, b, c):
        s.add_request(r)
    first = s.schedule()  # a and b; c waits for a free seat
    build_step_inputs(first, BS, CPU, torch.int64, input_batch=batch)
    assert (batch.row_of(a), batch.row_of(b)) == (0, 1)
    s.free(s.update(first, ModelRunnerOutput(sampled={"a": 7, "b": 7})).finished)  # a is done
    second = s.schedule()
    assert [x.request for x in second.scheduled] == [b, c]
    inputs = build_step_inputs(second, BS, CPU, torch.int64, input_batch=batch)
    assert (batch.row_of(a), batch.row_of(b), batch.row_of(c), batch.num_reqs) == (None, 1, 0, 2)
    assert batch.block_table.block_table_np[:2, :3].tolist() == [c.block_table + [0], b.block_table + [0]]
    assert as_lists(inputs) == reference_inputs(second)


def test_a_preempted_requests_row_is_rebuilt_from_its_new_blocks():
    kv = KVCacheManager(BlockPool(8), BS, lambda src, dst: None)
    batch = InputBatch(2, 4, CPU)
    r, other = request("r", list(range(3, 10)), 8), request("o", list(range(20, 26)), 8)
    assert kv.allocate_slots(r, 7) and kv.allocate_slots(other, 6)
    step = SchedulerOutput([ScheduledRequest(r, 7), ScheduledRequest(other, 6)])
    build_step_inputs(step, BS, CPU, torch.int64, input_batch=batch)
    row = batch.row_of(r)
    assert batch.block_table.block_table_np[row, :3].tolist() == [0, 1, 0]
    # preempted and scheduled again with no step built in between: its row still exists
    kv.free(r)
    r.reset_progress()
    assert kv.allocate_slots(other, 1) and kv.allocate_slots(r, 7)
    assert r.block_table == [4, 5]  # the freed blocks sit at the free queue's tail
    step = SchedulerOutput([ScheduledRequest(r, 7)])
    inputs = build_step_inputs(step, BS, CPU, torch.int64, input_batch=batch)
    assert inputs.block_table.tolist() == [[4, 5]] and inputs.slot_mapping.tolist()[:4] == [16, 17, 18, 19]
    assert batch.num_reqs == 1 and batch.block_table.block_table_np[batch.row_of(r), :3].tolist() == [4, 5, 0]


def test_a_step_appends_only_the_new_block_ids_to_a_row():
    batch = InputBatch(2, 4, CPU)
    r = Request("r", list(range(8)), SamplingParams(temperature=0))
    r.block_table = [3, 4]
    row = batch.update([r])[0]
    table = batch.block_table.block_table_np
    table[row, 0] = 99  # a marker: an append leaves it, a rewrite of the row would not
    r.block_table.append(6)
    assert batch.update([r]) == [row]
    assert table[row].tolist() == [99, 4, 6, 0]
    r.block_table = [3, 4, 6]  # another list object: the row is rewritten
    batch.update([r])
    assert table[row].tolist() == [3, 4, 6, 0]


def test_commit_copies_the_span_of_changed_rows_or_only_those_rows(monkeypatch):
    import weir.engine.input_batch as input_batch

    table = BlockTable(8, 3, CPU)
    table.block_table_device = torch.full_like(table.block_table_cpu, -7)  # stands in for device memory
    table.add_row(1, [5, 6])
    table.add_row(2, [8])
    assert table.changed_rows == [1, 2]
    table.commit()
    assert table.block_table_device[:4].tolist() == [[-7] * 3, [5, 6, 0], [8, 0, 0], [-7] * 3]
    table.append_row(2, [9])
    table.commit()
    table.commit()  # nothing changed since: no copy
    assert table.block_table_device[2].tolist() == [8, 9, 0] and table.changed_rows == []
    # rows 0 and 5 changed, a span of 6 rows: over the span limit only the two rows travel
    monkeypatch.setattr(input_batch, "SPAN_COPY_MAX_BYTES", 0)
    table.block_table_device[:] = -7
    table.add_row(0, [1])
    table.add_row(5, [2, 3, 4])
    table.commit()
    assert table.block_table_device[:6].tolist() == [[1, 0, 0]] + [[-7] * 3] * 4 + [[2, 3, 4]]
    table.block_table_device[table.zero_row] = 0
    rows = torch.tensor([5, table.zero_row, 0])
    assert table.gather(rows, 2, torch.int64).tolist() == [[2, 3], [0, 0], [1, 0]]


def test_a_steps_block_table_is_not_changed_by_later_steps():
    batch = InputBatch(1, 2, CPU)
    r = Request("r", list(range(5)), SamplingParams(temperature=0))
    r.block_table = [3, 4]
    # int32, the table's own dtype: no conversion copy could hide an alias of the persistent rows
    first = build_step_inputs(SchedulerOutput([ScheduledRequest(r, 5)]), BS, CPU, torch.int32, input_batch=batch)
    r.block_table = [1, 2]
    build_step_inputs(SchedulerOutput([ScheduledRequest(r, 5)]), BS, CPU, torch.int32, input_batch=batch)
    assert first.block_table.tolist() == [[3, 4]] and first.slot_mapping.tolist() == [12, 13, 14, 15, 16]


def test_decode_steps_hash_and_offer_only_the_blocks_they_fill(monkeypatch):
    import weir.engine.kv_cache_manager as kvm

    kv = KVCacheManager(BlockPool(64), BS, lambda src, dst: None)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=256)
    r = request("r", list(range(3, 123)), 40)  # 120 prompt tokens: 30 full blocks
    s.add_request(r)
    sched = s.schedule()
    s.update(sched, ModelRunnerOutput(sampled={"r": 7}))
    hashed, offered = [], []
    real_hash, real_offer = kvm.hash_block_tokens, kv.pool.cache_full_block
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda *a: hashed.append(a[1]) or real_hash(*a))
    monkeypatch.setattr(kv.pool, "cache_full_block", lambda b, h: offered.append(b.block_id) or real_offer(b, h))
    for _ in range(8):  # tokens 120..127 computed: block 30 fills at the 4th decode, block 31 at the 8th
        sched = s.schedule()
        s.update(sched, ModelRunnerOutput(sampled={"r": 7}))
    assert offered == [30, 31] and len(hashed) == 2
