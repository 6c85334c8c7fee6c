"""The torch reference attention backend: SDPA over keys/values gathered from the paged cache.

Used where neither the Triton kernels (CUDA fp16/bf16) nor the CPU C kernel (CPU fp32) run, and
the oracle those paths are tested against. From the step's common fields it derives three
groups, in packed order: decodes (one batched SDPA over their whole blocks, masked to each
context), chunks over a cached prefix (one padded SDPA batch with a causal mask offset by the
prefix) and fresh prompt chunks (causal SDPA each, straight from the step's keys/values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from weir.engine.step_inputs import StepInputs


@dataclass
class DecodeBatch:
    """Decode rows ``[first, first + num_seqs)``: one query token each, read through the cache.

    Attributes:
        block_table: ``[num_seqs, max_num_blocks]`` int64.
        mask: ``[num_seqs, 1, 1, max_seq_len]`` bool, True on each context's positions.
    """

    first: int
    num_seqs: int
    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass
class ContextPrefillBatch:
    """Prefill chunks over a cached prefix (rows ``[first, end)``), run as one padded SDPA call.

    Attributes:
        rows: ``[num_seqs, max_query_len]`` int64 packed-step row of each query (padding: 0).
        valid: ``[num_seqs, max_query_len]`` bool, False on padding.
        block_table: ``[num_seqs, max_num_blocks]`` int64.
        mask: ``[num_seqs, 1, max_query_len, max_seq_len]`` bool: query i of a chunk starting at
            position p sees positions ``<= p + i``; padding queries see position 0 only.
    """

    first: int
    end: int
    rows: torch.Tensor
    valid: torch.Tensor
    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass
class WindowedContext:
    """What a sliding-window layer reads for a group of rows: from each row's block table only the
    blocks from the first one its window reaches (block-table entries before it, which may name
    freed blocks, are never indexed), and the band mask over those blocks' positions.

    Attributes:
        block_table: ``[num_seqs, num_cols]`` int64, the block ids of each row's
            ``first_block .. first_block + num_cols - 1`` (past a row's context: the table's
            padding, masked).
        mask: ``[num_seqs, 1, max_query_len, num_cols * block_size]`` bool: key at position ``k``
            is visible to the query at position ``q`` iff ``q - window < k <= q``; padding queries
            see what the row's first query sees.
    """

    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass
class TorchAttentionMetadata:
    """What :class:`TorchAttentionBackend` reads in one step.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64; only the first ``num_actual_tokens`` are written.
        decodes: the decode rows, or None.
        context_prefills: the chunks over a cached prefix, or None.
        prefills: ``(query_start, query_len)`` of each fresh prompt chunk.
        inputs: the step's inputs, read when a sliding-window layer first asks for its window.
        windowed: per window size, the :class:`WindowedContext` of the decodes and of the chunks
            over a prefix (None where there are none), built by the first layer with that window.
    """

    slot_mapping: torch.Tensor
    num_actual_tokens: int
    decodes: DecodeBatch | None = None
    context_prefills: ContextPrefillBatch | None = None
    prefills: list[tuple[int, int]] = field(default_factory=list)
    inputs: StepInputs | None = None
    windowed: dict[int, tuple[WindowedContext | None, WindowedContext | None]] = field(default_factory=dict)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into their cache slots.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 slot per token (no -1 entries).
    """
    kvh, hd = key.shape[1], key.shape[2]
    key_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """``[num_seqs, num_kv_heads, max_seq_len, head_dim]`` context of each block-table row.

    Whole blocks are gathered (one index per block, not per token), then cut to ``max_seq_len``;
    positions past a row's context hold whatever its padding blocks hold and must be masked.
    """
    kvh, hd = cache.shape[0], cache.shape[3]
    n = block_table.shape[0]
    return cache[:, block_table].view(kvh, n, -1, hd)[:, :, :max_seq_len].transpose(0, 1)


class TorchAttentionBackend:
    """Attention and cache writes in plain torch (SDPA); any device and dtype."""

    name = "torch"
    index_dtype = torch.int64
    model_kernels = False  # the model's norms, rotary and SwiGLU stay in torch

    def build_metadata(self, inputs: StepInputs) -> TorchAttentionMetadata:
        """Masks and row lists of one step, from its common fields (decodes from row 0)."""
        meta = TorchAttentionMetadata(inputs.slot_mapping, inputs.num_actual_tokens, inputs=inputs)
        nd = inputs.num_decodes
        if nd:
            meta.decodes = self._decode_batch(inputs, 0, nd)
        self._add_prefills(meta, inputs, nd)
        return meta

    @staticmethod
    def _decode_batch(inputs: StepInputs, first: int, end: int) -> DecodeBatch:
        seq_lens = inputs.seq_lens[first:end]
        max_seq_len = max(inputs.seq_lens_cpu[first:end])
        valid = torch.arange(max_seq_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
        return DecodeBatch(first, end - first, inputs.block_table[first:end], valid[:, None, None, :])

    @staticmethod
    def _add_prefills(meta: TorchAttentionMetadata, inputs: StepInputs, first: int) -> None:
        """Requests ``first..num_reqs``: chunks over a prefix (packed first), then fresh chunks."""
        loc, seq_lens = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
        end = first
        while end < inputs.num_reqs and seq_lens[end] > loc[end + 1] - loc[end]:
            end += 1
        if end > first:
            meta.context_prefills = TorchAttentionBackend._context_batch(inputs, first, end)
        for i in range(end, inputs.num_reqs):
            meta.prefills.append((loc[i], loc[i + 1] - loc[i]))

    @staticmethod
    def _context_batch(inputs: StepInputs, first: int, end: int) -> ContextPrefillBatch:
        loc, seq_lens = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
        dev = inputs.seq_lens.device
        query_lens = [loc[i + 1] - loc[i] for i in range(first, end)]
        max_q = max(query_lens)
        max_seq_len = max(seq_lens[first:end])
        rows, valid, prefix_lens = [], [], []
        for i, n in zip(range(first, end), query_lens):
            rows.append(list(range(loc[i], loc[i] + n)) + [0] * (max_q - n))
            valid.append([True] * n + [False] * (max_q - n))
            prefix_lens.append(seq_lens[i] - n)
        valid_t = torch.tensor(valid, device=dev)
        # key j is visible to query i iff j <= prefix_len + i; padding queries see key 0 only
        q_pos = torch.tensor(prefix_lens, device=dev)[:, None] + torch.arange(max_q, device=dev)[None, :]
        q_pos = torch.where(valid_t, q_pos, 0)
        mask = torch.arange(max_seq_len, device=dev)[None, None, :] <= q_pos[:, :, None]
        return ContextPrefillBatch(first, end, torch.tensor(rows, dtype=torch.long, device=dev), valid_t,
                                   inputs.block_table[first:end], mask[:, None])

    @staticmethod
    def _windowed_context(inputs: StepInputs, first: int, end: int, window: int,
                          block_size: int) -> WindowedContext:
        """The :class:`WindowedContext` of rows ``[first, end)`` of the step."""
        loc, seq_lens = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
        dev = inputs.seq_lens.device
        query_lens = [loc[i + 1] - loc[i] for i in range(first, end)]
        prefix_lens = [seq_lens[i] - n for i, n in zip(range(first, end), query_lens)]
        first_blocks = [max(p - window + 1, 0) // block_size for p in prefix_lens]
        num_cols = max(-(-seq_lens[i] // block_size) - b for i, b in zip(range(first, end), first_blocks))
        width = inputs.block_table.shape[1]
        first_t = torch.tensor(first_blocks, device=dev)[:, None]
        cols = (first_t + torch.arange(num_cols, device=dev)[None, :]).clamp(max=width - 1)
        table = inputs.block_table[first:end].gather(1, cols)
        max_q = max(query_lens)
        # q_pos: [num_seqs, max_q], padding queries at the row's first query; k_pos: [num_seqs, L]
        steps = torch.arange(max_q, device=dev)[None, :]
        q_pos = torch.tensor(prefix_lens, device=dev)[:, None] + steps
        q_pos = torch.where(steps < torch.tensor(query_lens, device=dev)[:, None], q_pos, q_pos[:, :1])
        k_pos = first_t * block_size + torch.arange(num_cols * block_size, device=dev)[None, :]
        mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] > q_pos[:, :, None] - window)
        return WindowedContext(table, mask[:, None])

    @staticmethod
    def _window(meta: TorchAttentionMetadata, window: int, block_size: int):
        """``(decodes, context_prefills)`` windowed contexts of the step, built once per window."""
        if window not in meta.windowed:
            d, c = meta.decodes, meta.context_prefills
            build = TorchAttentionBackend._windowed_context
            meta.windowed[window] = (
                None if d is None else build(meta.inputs, d.first, d.first + d.num_seqs, window, block_size),
                None if c is None else build(meta.inputs, c.first, c.end, window, block_size),
            )
        return meta.windowed[window]

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: TorchAttentionMetadata) -> None:
        """:func:`write_kv_cache` of the step's first ``num_actual_tokens`` tokens."""
        n = meta.num_actual_tokens
        if n == key.shape[0]:
            write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        elif n:
            write_kv_cache(key[:n], value[:n], key_cache, value_cache, meta.slot_mapping[:n])

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, meta: TorchAttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of one packed step, reading context through the paged cache.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens (already
                written to the cache with :meth:`write_kv`).
            key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
            meta: from :meth:`build_metadata`.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            sliding_window: None (global attention), or ``W >= 1``: the query at position ``p``
                sees keys at positions ``p - W + 1 .. p`` only (transformers' convention), and
                block-table entries of blocks wholly before that are never read.

        Returns:
            ``[num_tokens, num_heads, head_dim]``, same dtype as ``query``.
        """
        out = torch.empty_like(query)
        self._forward_torch(out, query, key, value, key_cache, value_cache, meta, scale, sliding_window)
        return out

    @staticmethod
    def _forward_torch(out, query, key, value, key_cache, value_cache, meta: TorchAttentionMetadata,
                       scale: float, sliding_window: int | None = None) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        kvh = key.shape[1]
        gqa = kvh != num_heads
        window_decodes = window_context = None
        if sliding_window is not None:
            window_decodes, window_context = TorchAttentionBackend._window(meta, sliding_window, key_cache.shape[2])
        if meta.context_prefills is not None:
            c = meta.context_prefills
            table, mask = (c.block_table, c.mask) if window_context is None else (
                window_context.block_table, window_context.mask)
            max_seq_len = mask.shape[-1]
            # q: [num_seqs, num_heads, max_query_len, head_dim]; k/v: [num_seqs, kvh, max_seq_len, head_dim]
            q = query[c.rows].permute(0, 2, 1, 3)
            k = gather_context(key_cache, table, max_seq_len)
            v = gather_context(value_cache, table, max_seq_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[c.rows[c.valid]] = o.permute(0, 2, 1, 3)[c.valid]
        d = meta.decodes
        if d is not None:
            # the query heads sharing a KV head ride in SDPA's query-length axis, so GQA needs no
            # copy of the keys/values per query head.
            # q: [num_seqs, num_kv_heads, heads_per_kv, head_dim]; k/v: [num_seqs, kvh, max_seq_len, head_dim]
            s, n = d.first, d.num_seqs
            table, mask = (d.block_table, d.mask) if window_decodes is None else (
                window_decodes.block_table, window_decodes.mask)
            q = query[s:s + n].view(n, kvh, num_heads // kvh, head_dim)
            max_seq_len = mask.shape[-1]
            k = gather_context(key_cache, table, max_seq_len)
            v = gather_context(value_cache, table, max_seq_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[s:s + n] = o.reshape(n, num_heads, head_dim)
        for s, n in meta.prefills:
            # q: [1, num_heads, n, head_dim]; k/v: [1, num_kv_heads, n, head_dim]
            q = query[s:s + n].transpose(0, 1).unsqueeze(0)
            k = key[s:s + n].transpose(0, 1).unsqueeze(0)
            v = value[s:s + n].transpose(0, 1).unsqueeze(0)
            if sliding_window is None or sliding_window >= n:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                # band: key j visible to query i iff i - W < j <= i
                pos = torch.arange(n, device=q.device)
                band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale, enable_gqa=gqa)
            out[s:s + n] = o.squeeze(0).transpose(0, 1)
