"""Decode attention over a paged KV cache: one query token per request.

Algorithm: PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): a request's keys/values live in fixed-size blocks found through its
block table. The softmax is computed in one pass with a running maximum and sum (the online softmax
of Milakov & Gimelshein 2018, as used by FlashAttention-2, Dao 2023), so no score vector of the
whole context is ever materialised. The K/V tile loop is :func:`weir.kernels.common.attend_paged_context`,
shared with the prefill kernel.

One program handles one (request, KV head) pair and all the query heads that share that KV head
(grouped-query attention): each key/value tile is loaded once for the whole group, and the group's
queries form the rows of a ``tl.dot``. Tiles of ``BLOCK_N`` context positions may span several
cache blocks; each position finds its block through the block table, so any power-of-two block size
>= 8 works with the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.kernels.common import LOG2_E, attend_paged_context, check, check_attention_args, interpreting
from weir.kernels.cpu_paged_attention import paged_attention_varlen_ref


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    window, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    # int64 ids: kv_head * stride_kh passes 2**31 with a cache of a few tens of GB per layer
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ctx_len = tl.load(context_lens_ptr + seq)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    head = kv_head * QUERIES_PER_KV + g
    # q: [BLOCK_G, BLOCK_D], the query heads of this KV head (rows past the group are zero)
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # the query is the context's last position, so it sees all of it (or, with a sliding window,
    # the last `window` positions, which are then the only ones read): no causal mask
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(ctx_len - window, 0)
    # out: [BLOCK_G, BLOCK_D] fp32
    out = attend_paged_context(
        q, ctx_len - 1, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bt, kv_start, ctx_len, window, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs,
        ROWS=BLOCK_G, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
        CAUSAL=False, WINDOWED=False, UPCAST=UPCAST, IEEE=IEEE,
    )
    tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def _check_args(query, key_cache, value_cache, block_tables, context_lens, out):
    check_attention_args(query, key_cache, value_cache, block_tables, context_lens, out)
    check(context_lens.shape[0] == query.shape[0],
          f"context_lens {tuple(context_lens.shape)} needs one entry per query ({query.shape[0]})")


def paged_attention_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per request to that request's cached context (Triton).

    Args:
        query: ``[num_seqs, num_heads, head_dim]`` fp16/bf16 (fp32 accepted: IEEE fp32
            products), unit stride in ``head_dim``. Query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``, same dtype
            as ``query``, unit stride in ``head_dim``; ``block_size`` a power of two >= 8.
        block_tables: ``[num_seqs, max_num_blocks]`` int32/int64 block ids; entries past a
            request's context are never read.
        context_lens: ``[num_seqs]`` int32/int64 tokens of context per request, the query's own
            key/value included (already written to the cache). 0 gives a zero output row.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_heads, head_dim]`` output tensor (same dtype as ``query``).
        sliding_window: None, or ``W >= 1``: the query sees only the last ``W`` positions of its
            context (transformers' sliding-window convention), and block-table entries before
            them are never read.

    Returns:
        ``out`` (or a new tensor): ``[num_seqs, num_heads, head_dim]`` in ``query``'s dtype;
        scores, softmax and the weighted sum accumulate in fp32.

    Raises:
        ValueError: a shape, dtype, device or stride does not match the above, or
            ``sliding_window < 1``.
    """
    _check_args(query, key_cache, value_cache, block_tables, context_lens, out)
    check(sliding_window is None or sliding_window >= 1,
          f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    qpk = num_heads // num_kv_heads
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, context_lens,
        sliding_window or 0, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=qpk, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(qpk)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=max(64, block_size), WINDOWED=sliding_window is not None,
        UPCAST=interpreting(), IEEE=query.dtype == torch.float32,
        num_warps=4,
    )
    return out


def paged_attention_decode_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain torch version of :func:`paged_attention_decode` (same arguments and result): request
    ``i``'s query is one token that sees its ``context_lens[i]`` positions (the last
    ``sliding_window`` of them with a window), computed by
    :func:`weir.kernels.cpu_paged_attention.paged_attention_varlen_ref` in fp32. Slow; it is the
    oracle of the tests."""
    _check_args(query, key_cache, value_cache, block_tables, context_lens, out)
    if out is None:
        out = torch.empty_like(query)
    token_seq = torch.arange(query.shape[0])
    out.copy_(paged_attention_varlen_ref(query, key_cache, value_cache, block_tables, token_seq,
                                         context_lens, scale, sliding_window=sliding_window))
    return out
