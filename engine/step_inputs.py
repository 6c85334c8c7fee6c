"""The inputs of one packed step, for every device and attention backend.

One builder turns a :class:`SchedulerOutput` into :class:`StepInputs`, whose fields are named as
vLLM's ``CommonAttentionMetadata`` names them; each attention backend (``weir.engine.attention``)
derives what else it needs from them. The step's integer fields are built as Python lists, packed
into one host tensor (pinned on CUDA) and moved with one non-blocking copy; the fields are views of
that single device tensor, so building a step never waits for the GPU.

Packed order, the same for every backend: decodes first (one new token each), then prefill chunks
over a cached prefix, shortest first, then fresh prompt chunks (nothing cached before them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

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
    decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
    prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
    with_prefix = sorted((s for s in prefills if s.request.num_computed_tokens), key=lambda s: s.num_new_tokens)
    fresh = [s for s in prefills if not s.request.num_computed_tokens]
    return decodes + with_prefix + fresh


def build_step_inputs(sched: SchedulerOutput, block_size: int, device: torch.device, index_dtype: torch.dtype,
                      num_padded_decodes: int | None = None, write_kv: bool = True,
                      block_table_width: int | None = None) -> StepInputs:
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

    Returns:
        The step's :class:`StepInputs`.

    Raises:
        ValueError: padding asked for a step that is not decode-only, or below its decode count.
    """
    ordered = packed_order(sched)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for s in ordered:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        bt = r.block_table
        ids.extend(r.all_token_ids[start:end])
        pos.extend(range(start, end))
        if write_kv:
            slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(start, end))
        starts.append(end - start + starts[-1])
        seq_lens.append(end)
        tables.append(bt)
    num_tokens = starts[-1]
    if not write_kv:
        slots = [-1] * num_tokens
    num_decodes = sum(1 for s in ordered if s.num_new_tokens == 1)
    if num_padded_decodes is not None:
        if num_decodes != len(ordered) or num_padded_decodes < num_decodes:
            raise ValueError(f"cannot pad a step of {num_decodes} decodes and {len(ordered) - num_decodes} "
                             f"prefills to {num_padded_decodes} decode rows")
        pad = num_padded_decodes - num_decodes
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad
        starts += range(num_tokens + 1, num_tokens + pad + 1)
        seq_lens += [0] * pad
        tables += [[]] * pad
        num_decodes = num_padded_decodes
    width = max(max(map(len, tables), default=0), block_table_width or 0, 1)
    flat_tables: list[int] = []
    for t in tables:
        flat_tables.extend(t)
        flat_tables.extend([0] * (width - len(t)))

    fields = [ids, pos, slots, starts, seq_lens, flat_tables]
    packed: list[int] = []
    for f in fields:
        packed.extend(f)
    host = torch.tensor(packed, dtype=index_dtype, pin_memory=device.type == "cuda")
    dev = host.to(device, non_blocking=True)
    ids_t, pos_t, slots_t, starts_t, seq_lens_t, tables_t = torch.split(dev, [len(f) for f in fields])
    return StepInputs(
        input_ids=ids_t, positions=pos_t, slot_mapping=slots_t, query_start_loc=starts_t,
        seq_lens=seq_lens_t, block_table=tables_t.view(len(tables), width), num_decodes=num_decodes,
        max_query_len=1 if num_padded_decodes else max((s.num_new_tokens for s in ordered), default=0),
        max_seq_len=max(seq_lens, default=0), num_actual_tokens=num_tokens if write_kv else 0,
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, requests=ordered,
    )
