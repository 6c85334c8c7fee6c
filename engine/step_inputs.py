"""Inputs of one packed step for the Triton path: built as Python lists, moved once.

Every integer field of the step (token ids, positions, slots, context lengths, block tables,
query offsets) goes into one int32 list, one pinned host tensor and one non-blocking copy; the
fields are views of that single device tensor. Building the step therefore never waits for the
GPU. (The torch reference path builds its own masks in ``weir.engine.model_runner``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.engine.attention import AttentionMetadata
from weir.engine.scheduler import ScheduledRequest


@dataclass
class KernelStep:
    """Device inputs of one step.

    Attributes:
        input_ids, positions: ``[num_rows]`` int32; ``num_rows`` is the number of tokens, or the
            CUDA-graph batch size when the decode rows are padded.
        meta: the step's :class:`AttentionMetadata` with ``use_kernels`` set.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def _slot(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def _padded_rows(tables: list[list[int]]) -> tuple[list[int], int]:
    width = max((len(t) for t in tables), default=0) or 1
    flat: list[int] = []
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    return flat, width


def build_kernel_step(decodes: list[ScheduledRequest], prefills: list[ScheduledRequest], block_size: int,
                      device: torch.device, num_padded_decodes: int | None = None) -> KernelStep:
    """Pack one step: the decodes (one new token each) first, then the prefill chunks.

    Args:
        decodes, prefills: the scheduled requests, in packed order.
        block_size: tokens per KV block.
        device: where the step runs.
        num_padded_decodes: for a decode-only step replayed by a CUDA graph, pad the rows to this
            batch size: padding rows have token 0, position 0, slot -1 (nothing written) and
            context length 0 (zero attention output).

    Returns:
        The :class:`KernelStep`; ``meta.decode_block_tables`` keeps only the real decode rows.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    decode_ctx: list[int] = []
    for s in decodes:
        r = s.request
        p = r.num_computed_tokens
        ids.append(r.all_token_ids[p])
        pos.append(p)
        slots.append(_slot(r.block_table, p, block_size))
        decode_ctx.append(p + 1)
    nd = len(decodes)
    if num_padded_decodes is not None:
        pad = num_padded_decodes - nd
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad
        decode_ctx += [0] * pad
    starts = [len(ids)]
    prefill_ctx: list[int] = []
    for s in prefills:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        ids.extend(r.all_token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(_slot(r.block_table, p, block_size) for p in range(start, end))
        starts.append(starts[-1] + s.num_new_tokens)
        prefill_ctx.append(end)
    decode_bt, decode_w = _padded_rows([s.request.block_table for s in decodes])
    prefill_bt, prefill_w = _padded_rows([s.request.block_table for s in prefills])

    fields = [ids, pos, slots, decode_ctx, decode_bt, starts, prefill_ctx, prefill_bt]
    packed: list[int] = []
    for f in fields:
        packed.extend(f)
    host = torch.tensor(packed, dtype=torch.int32, pin_memory=device.type == "cuda")
    dev = host.to(device, non_blocking=True)
    views = list(torch.split(dev, [len(f) for f in fields]))
    ids_t, pos_t, slots_t, dctx_t, dbt_t, starts_t, pctx_t, pbt_t = views
    meta = AttentionMetadata(slot_mapping=slots_t, num_decode_tokens=len(decode_ctx), use_kernels=True)
    if decode_ctx:
        meta.decode_context_lens = dctx_t
        meta.decode_block_tables = dbt_t.view(nd, decode_w)
    if prefills:
        meta.prefill_query_start_loc = starts_t
        meta.prefill_context_lens = pctx_t
        meta.prefill_block_tables = pbt_t.view(len(prefills), prefill_w)
        meta.max_prefill_query_len = max(s.num_new_tokens for s in prefills)
    return KernelStep(ids_t, pos_t, meta)
