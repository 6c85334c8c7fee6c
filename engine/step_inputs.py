"""The inputs of one packed step, for every device and attention backend.

One builder turns a :class:`SchedulerOutput` into :class:`StepInputs`, whose fields are named as
vLLM's ``CommonAttentionMetadata`` names them; each attention backend (``weir.engine.attention``)
derives what else it needs from them. The step's per-token and per-request integers are computed
with numpy from a few per-request numbers (after vLLM V1's ``_prepare_inputs``), packed into one
host tensor (pinned on CUDA) and moved with one non-blocking copy; those fields are views of that
single device tensor. The block table comes from the persistent
:class:`~weir.engine.input_batch.InputBatch`: each step copies only its changed rows to the device
and gathers the step's rows there, so building a step never waits for the GPU and costs the same
whatever the requests' context lengths.

Packed order, the same for every backend: decodes first (one new token each), then prefill chunks
over a cached prefix, shortest first, then fresh prompt chunks (nothing cached before them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from weir.engine.input_batch import InputBatch
from weir.engine.scheduler import ScheduledRequest, SchedulerOutput

@dataclass
class StepInputs:
    """Device inputs of one step. ``num_reqs`` rows: the scheduled requests in packed order, then
    any padding rows of a CUDA-graph batch (token 0, position 0, slot -1, one query token,
    ``seq_lens`` 0 so the attention output is zero).

    Attributes:
        input_ids, positions: ``[num_tokens]`` token id and position of each packed token.
        slot_mapping: ``[num_tokens]`` cache slot (``block_id * block_size + offset``) each token's
            key/value is written to; -1 writes nothing (padding, the memory-profiling step).
        query_start_loc: ``[num_reqs + 1]`` cumulative query lengths, from 0.
        seq_lens: ``[num_reqs]`` cached prefix + new tokens of each request.
        block_table: ``[num_reqs, max_num_blocks]`` block ids (padding: block 0).
        num_decodes: the first ``num_decodes`` requests have one query token each.
        max_query_len, max_seq_len: host ints, the largest entries of the two above.
        num_actual_tokens: the leading tokens whose keys/values are written; the rest have slot -1.
        query_start_loc_cpu, seq_lens_cpu: host copies of ``query_start_loc`` and ``seq_lens``.
        requests: the scheduled requests in packed order (no padding rows).

    Every integer tensor has the dtype the backend asked for (int32 for the Triton kernels,
    int64 for torch indexing and the CPU kernel) and lives on the step's device.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    requests: list[ScheduledRequest]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def decode_rows(self, num_rows: int) -> StepInputs:
        """The first ``num_rows`` rows of a decode-only step, as views (what a CUDA graph of that
        batch size reads)."""
        return replace(
            self, input_ids=self.input_ids[:num_rows], positions=self.positions[:num_rows],
            slot_mapping=self.slot_mapping[:num_rows], query_start_loc=self.query_start_loc[:num_rows + 1],
            seq_lens=self.seq_lens[:num_rows], block_table=self.block_table[:num_rows],
            num_decodes=num_rows, num_actual_tokens=min(self.num_actual_tokens, num_rows),
            query_start_loc_cpu=self.query_start_loc_cpu[:num_rows + 1],
            seq_lens_cpu=self.seq_lens_cpu[:num_rows], requests=self.requests[:num_rows],
        )


def packed_order(sched: SchedulerOutput) -> list[ScheduledRequest]:
    """Decodes, then chunks over a cached prefix (shortest first, ties in schedule order), then
    fresh prompt chunks."""
    decodes, with_prefix, fresh = [], [], []
    for s in sched.scheduled:
        if s.num_new_tokens == 1:
            decodes.append(s)
        elif s.request.num_computed_tokens:
            with_prefix.append(s)
        else:
            fresh.append(s)
    with_prefix.sort(key=lambda s: s.num_new_tokens)  # stable: ties keep schedule order
    return decodes + with_prefix + fresh


def build_step_inputs(sched: SchedulerOutput, block_size: int, device: torch.device, index_dtype: torch.dtype,
                      num_padded_decodes: int | None = None, write_kv: bool = True,
                      block_table_width: int | None = None, input_batch: InputBatch | None = None) -> StepInputs:
    """Pack one step in :func:`packed_order`.

    Args:
        sched: the scheduled requests and their new-token counts.
        block_size: tokens per KV block.
        device: where the step runs.
        index_dtype: ``torch.int32`` or ``torch.int64``, the dtype of every field.
        num_padded_decodes: for a decode-only step replayed by a CUDA graph, pad the rows to this
            batch size (see :class:`StepInputs` for the padding rows).
        write_kv: False gives every token slot -1 (the memory-profiling step, which must leave
            the cache as it is).
        block_table_width: at least this many ``block_table`` columns (the static buffers of the
            CUDA graphs, sized for ``max_model_len``).
        input_batch: the persistent batch of the model runner, updated with this step's requests
            (each step then costs O(requests + blocks added)); None builds a one-step batch, whose
            rows cost O(blocks held).

    Returns:
        The step's :class:`StepInputs`.

    Raises:
        ValueError: padding asked for a step that is not decode-only, or below its decode count.
    """
    ordered = packed_order(sched)
    num_reqs = len(ordered)
    num_decodes = sum(1 for s in ordered if s.num_new_tokens == 1)
    num_rows = num_reqs
    if num_padded_decodes is not None:
        if num_decodes != num_reqs or num_padded_decodes < num_decodes:
            raise ValueError(f"cannot pad a step of {num_decodes} decodes and {num_reqs - num_decodes} "
                             f"prefills to {num_padded_decodes} decode rows")
        num_rows = num_decodes = num_padded_decodes
    if input_batch is None:
        input_batch = InputBatch(num_reqs, max((len(s.request.block_table) for s in ordered), default=1), device)
    table = input_batch.block_table
    table.ensure_size(table.max_num_reqs, block_table_width or 1)
    rows = input_batch.update([s.request for s in ordered])

    computed, num_new, ids = [], [], []
    for s in ordered:
        c, n = s.request.num_computed_tokens, s.num_new_tokens
        computed.append(c)
        num_new.append(n)
        ids += s.request.all_token_ids[c:c + n]
    num_tokens = len(ids)
    num_pad = num_rows - num_reqs
    num_slots = num_tokens + num_pad  # a padding row has one query token

    # one host buffer: ids, positions, slots [num_slots]; query_start_loc [num_rows + 1];
    # seq_lens, block-table rows [num_rows]
    sizes = [num_slots, num_slots, num_slots, num_rows + 1, num_rows, num_rows]
    host = torch.empty(sum(sizes), dtype=index_dtype, pin_memory=device.type == "cuda")
    ids_np, pos_np, slots_np, qsl_np, seq_lens_np, rows_np = np.split(host.numpy(), np.cumsum(sizes[:-1]))
    num_new_np = np.array(num_new, dtype=ids_np.dtype)
    computed_np = np.array(computed, dtype=ids_np.dtype)
    qsl_np[0] = 0
    np.cumsum(num_new_np, out=qsl_np[1:num_reqs + 1])
    qsl_np[num_reqs + 1:] = np.arange(num_tokens + 1, num_slots + 1)
    seq_lens_np[:num_reqs] = computed_np + num_new_np
    seq_lens_np[num_reqs:] = 0
    rows_np[:num_reqs] = rows
    rows_np[num_reqs:] = table.zero_row
    ids_np[:num_tokens] = ids
    if num_tokens == num_reqs:  # decodes only: one token per row
        pos_np[:num_tokens] = computed_np
        token_rows = rows_np[:num_reqs]
    else:  # position of packed token t of request i: computed[i] + t - query_start_loc[i]
        pos_np[:num_tokens] = np.repeat(computed_np - qsl_np[:num_reqs], num_new_np) + np.arange(num_tokens)
        token_rows = np.repeat(rows_np[:num_reqs], num_new_np)
    ids_np[num_tokens:] = pos_np[num_tokens:] = 0
    slots_np[:] = -1
    if write_kv:
        pos = pos_np[:num_tokens]
        slots_np[:num_tokens] = table.block_table_np[token_rows, pos // block_size] * block_size + pos % block_size
    dev = host.to(device, non_blocking=True)
    ids_t, pos_t, slots_t, starts_t, seq_lens_t, rows_t = torch.split(dev, sizes)

    width = max(int(table.num_blocks_per_row[rows_np[:num_reqs]].max(initial=0)), block_table_width or 0, 1)
    table.commit()
    seq_lens_cpu = seq_lens_np.tolist()
    return StepInputs(
        input_ids=ids_t, positions=pos_t, slot_mapping=slots_t, query_start_loc=starts_t, seq_lens=seq_lens_t,
        block_table=table.gather(rows_t, width, index_dtype), num_decodes=num_decodes,
        max_query_len=1 if num_padded_decodes else max(num_new, default=0),
        max_seq_len=max(seq_lens_cpu, default=0), num_actual_tokens=num_tokens if write_kv else 0,
        query_start_loc_cpu=qsl_np.tolist(), seq_lens_cpu=seq_lens_cpu, requests=ordered,
    )
