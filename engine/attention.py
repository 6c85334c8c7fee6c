"""Attention over the paged KV cache: metadata for one step and the torch reference path.

The KV cache of one layer is ``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major, so
that a request's gathered context is ``[num_kv_heads, context_len, head_dim]`` with each head
contiguous: attention reads it without a transpose copy). A token's *slot* is
``block_id * block_size + offset``; a request's context is read through its block table.

The tokens of one step are packed: decode tokens first (one query token per request), then
prefill chunks over an already-computed prefix (short ones beside the decodes in the CPU kernel,
``varlen``; longer ones as one padded batch, ``context_prefills``), then fresh prompt chunks
(causal over themselves only, ``prefills``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """A fresh prompt chunk (nothing cached before it) inside a packed step: causal attention over
    its own keys/values, straight from the step.

    Attributes:
        query_start: index of the chunk's first token in the packed step.
        query_len: number of new tokens in the chunk.
    """

    query_start: int
    query_len: int


@dataclass
class VarlenMeta:
    """Tokens that read cached context through the CPU kernel (``weir.kernels.cpu_paged_attention``):
    the first ``num_tokens`` of the step.

    Attributes:
        block_tables: ``[num_seqs, max_num_blocks]`` int64.
        token_seq: ``[num_tokens]`` int64 row of ``block_tables`` per token.
        token_ctx: ``[num_tokens]`` int64 positions each token sees (its position + 1).
        max_ctx: ``max(token_ctx)``.
    """

    num_tokens: int
    block_tables: torch.Tensor
    token_seq: torch.Tensor
    token_ctx: torch.Tensor
    max_ctx: int


@dataclass
class ContextPrefillBatch:
    """Prefill chunks over a cached prefix, run as one padded SDPA call (torch path).

    Attributes:
        rows: ``[num_seqs, max_query_len]`` int64 packed-step row of each query (padding: 0).
        valid: ``[num_seqs, max_query_len]`` bool, False on padding.
        slots: ``[num_seqs, max_context_len]`` int64 cache slot of each context position (padding: 0).
        mask: ``[num_seqs, 1, max_query_len, max_context_len]`` bool: query i of a chunk starting at
            position p sees positions ``<= p + i``; padding queries see position 0 only.
    """

    rows: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything attention needs for one packed step.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, where each new token's key/value is written.
        num_decode_tokens: the first ``num_decode_tokens`` tokens are decodes, one per request.
        decode_block_tables: ``[num_decodes, max_num_blocks]`` int64 block ids (padding: 0).
        decode_context_mask: ``[num_decodes, 1, 1, max_context_len]`` bool, True where valid.
        prefills: fresh prompt chunks (no cached prefix), packed last.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_mask: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    varlen: VarlenMeta | None = None  # CPU kernel tokens (then num_decode_tokens is 0)
    context_prefills: ContextPrefillBatch | None = None  # long chunks over a prefix, batched
    # Triton path (see use_kernels): int32 tensors read by the kernels, no masks or slot lists.
    # decode_context_lens: [num_decodes]; prefill_block_tables: [num_prefills, max_num_blocks];
    # prefill_query_start_loc: [num_prefills + 1], starting at num_decode_tokens;
    # prefill_context_lens: [num_prefills]; max_prefill_query_len: host int (0 = no prefill).
    use_kernels: bool = False
    decode_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    max_prefill_query_len: int = 0


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into their cache slots.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 slot per token.
    """
    kvh, hd = key.shape[1], key.shape[2]
    key_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, hd).index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Causal attention for one packed step, reading context through the paged cache (torch).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens (already written
            to the cache with :func:`write_kv_cache`).
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output, same dtype as ``query``.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    kvh = key.shape[1]
    out = torch.empty_like(query)
    flat_k = key_cache.view(kvh, -1, head_dim)
    flat_v = value_cache.view(kvh, -1, head_dim)
    if meta.varlen is not None:
        from weir.kernels.cpu_paged_attention import paged_attention_varlen

        v = meta.varlen
        out[:v.num_tokens] = paged_attention_varlen(query[:v.num_tokens], key_cache, value_cache,
                                                    v.block_tables, v.token_seq, v.token_ctx, scale, v.max_ctx)
    if meta.context_prefills is not None:
        c = meta.context_prefills
        # q: [num_seqs, num_heads, max_query_len, head_dim]; k/v: [num_seqs, kvh, max_context_len, head_dim]
        q = query[c.rows].permute(0, 2, 1, 3)
        k = flat_k[:, c.slots].transpose(0, 1)
        v = flat_v[:, c.slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scale, enable_gqa=kvh != num_heads)
        out[c.rows[c.valid]] = o.permute(0, 2, 1, 3)[c.valid]
    nd = meta.num_decode_tokens
    if nd:
        # whole blocks are gathered (one index per block, not per token), then cut to max_ctx.
        # The query heads sharing a KV head ride in SDPA's query-length axis, so GQA needs no
        # copy of the keys/values per query head.
        # q: [num_decodes, num_kv_heads, heads_per_kv, head_dim]; k/v: [num_decodes, kvh, max_ctx, head_dim]
        q = query[:nd].view(nd, kvh, num_heads // kvh, head_dim)
        bt = meta.decode_block_tables
        max_ctx = meta.decode_context_mask.shape[-1]
        k = key_cache[:, bt].view(kvh, nd, -1, head_dim)[:, :, :max_ctx].transpose(0, 1)
        v = value_cache[:, bt].view(kvh, nd, -1, head_dim)[:, :, :max_ctx].transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_context_mask, scale=scale)
        out[:nd] = o.reshape(nd, num_heads, head_dim)
    for p in meta.prefills:
        s, n = p.query_start, p.query_len
        # q: [1, num_heads, n, head_dim]; k/v: [1, num_kv_heads, n, head_dim]
        q = query[s:s + n].transpose(0, 1).unsqueeze(0)
        k = key[s:s + n].transpose(0, 1).unsqueeze(0)
        v = value[s:s + n].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kvh != num_heads)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


# ---- dispatch: Triton kernels on CUDA, the torch reference above elsewhere ----------------------


def use_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the Triton kernels of ``kernels/`` run attention and cache writes: CUDA tensors
    in fp16/bf16. Everywhere else (CPU, fp32) the torch functions above are used and stay the
    oracle the kernels are tested against."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """:func:`write_kv_cache` or, with ``meta.use_kernels``, ``weir.kernels.kv_cache.write_kv_cache``
    (which also skips slot -1, the padding rows of a CUDA-graph batch)."""
    if not meta.use_kernels:
        write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return
    from weir.kernels.kv_cache import write_kv_cache as write_kv_cache_kernel

    write_kv_cache_kernel(key, value, key_cache, value_cache, meta.slot_mapping)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Attention of one packed step (same arguments and result as :func:`paged_attention`).

    With ``meta.use_kernels`` the decode rows go to ``weir.kernels.paged_attention`` and the prefill
    rows to ``weir.kernels.prefill_attention``; both read keys/values through the block tables only.
    """
    if not meta.use_kernels:
        return paged_attention(query, key, value, key_cache, value_cache, meta, scale)
    from weir.kernels.paged_attention import paged_attention_decode
    from weir.kernels.prefill_attention import prefill_attention

    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        paged_attention_decode(query[:nd], key_cache, value_cache, meta.decode_block_tables,
                               meta.decode_context_lens, scale, out=out[:nd])
    if meta.max_prefill_query_len:
        prefill_attention(query, key_cache, value_cache, meta.prefill_block_tables,
                          meta.prefill_query_start_loc, meta.prefill_context_lens,
                          meta.max_prefill_query_len, scale, out=out)
    return out
