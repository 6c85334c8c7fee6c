"""Causal attention for packed prefill chunks whose requests may already have a cached prefix.

Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning"): a tile of ``BLOCK_M`` queries keeps a running maximum, sum and fp32
output while it streams over key/value tiles, so the score matrix is never materialised. Keys and
values are read through the block table as in PagedAttention (Kwon et al. 2023), which lets one
kernel serve a whole prompt, a later chunk of a chunked prefill, and a prompt whose first blocks
came from the prefix cache: all three are "``query_len`` new tokens at the end of a
``context_len``-token context". The K/V tile loop is :func:`weir.kernels.common.attend_paged_context`,
shared with the decode kernel.

The new tokens' keys/values must already be in the cache (write them first with
``weir.kernels.kv_cache.write_kv_cache``). Grid: (query tiles, requests, query heads); tiles past a
request's ``query_len`` do no work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.kernels.common import (
    INDEX_DTYPES, LOG2_E, attend_paged_context, check, check_attention_args, check_tensor, interpreting,
)
from weir.kernels.cpu_paged_attention import paged_attention_varlen_ref


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    window, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    # int64: kv_head * stride_kh passes 2**31 with a cache of a few tens of GB per layer
    kv_head = (head // QUERIES_PER_KV).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix_len = ctx_len - q_len

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    # q: [BLOCK_M, BLOCK_D]; query row i sits at context position prefix_len + i
    q = tl.load(q_ptr + (q_start + m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix_len + m

    # keys past the tile's last query are masked for every row; an idle tile runs no iteration
    kv_end = tl.minimum(ctx_len, prefix_len + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    # with a sliding window, keys before the tile's first query's window are masked for every row
    # (and never read: their blocks may have been freed)
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0)
    # out: [BLOCK_M, BLOCK_D] fp32, causal within the context
    out = attend_paged_context(
        q, q_pos, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bt, kv_start, kv_end, window, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs,
        ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
        CAUSAL=True, WINDOWED=WINDOWED, UPCAST=UPCAST, IEEE=IEEE,
    )
    tl.store(out_ptr + (q_start + m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _check_args(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out):
    check_attention_args(query, key_cache, value_cache, block_tables, context_lens, out)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES, query.device)
    num_seqs = context_lens.shape[0]
    check(query_start_loc.shape[0] == num_seqs + 1,
          f"query_start_loc {tuple(query_start_loc.shape)} needs num_seqs + 1 entries "
          f"(num_seqs={num_seqs})")
    check(query_start_loc.stride(0) == 1, "query_start_loc must be contiguous")


def prefill_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float, out: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks to their paged context (Triton).

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` (``query_len``
    new tokens); they are the last ``query_len`` of its ``context_lens[i]`` context positions, so
    row ``j`` of the chunk attends to positions ``0 .. context_lens[i] - query_len + j``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16 (fp32 accepted: IEEE fp32
            products), unit stride in ``head_dim``; rows outside every request's range are left
            untouched in ``out``.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]`` holding every
            context position (the new tokens included); ``block_size`` a power of two >= 8.
        block_tables: ``[num_seqs, max_num_blocks]`` int32/int64 block ids.
        query_start_loc: ``[num_seqs + 1]`` int32/int64 cumulative query lengths (starts at 0,
            or at the first prefill row of a packed step).
        context_lens: ``[num_seqs]`` int32/int64, cached prefix + new tokens per request.
        max_query_len: the longest chunk (a host int: it sizes the grid without reading the GPU).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_tokens, num_heads, head_dim]`` output (same dtype as ``query``).
        sliding_window: None, or ``W >= 1``: the row at position ``p`` sees only positions
            ``p - W + 1 .. p`` (transformers' sliding-window convention); block-table entries
            wholly before the first row's window are never read.

    Returns:
        ``out`` (or a new tensor) in ``query``'s dtype; accumulation in fp32.

    Raises:
        ValueError: a shape, dtype, device or stride does not match the above, or
            ``sliding_window < 1``.
    """
    _check_args(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out)
    check(sliding_window is None or sliding_window >= 1,
          f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, _, block_size, _ = key_cache.shape
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return out
    block_m = 64 if max_query_len > 32 else max(16, triton.next_power_of_2(max_query_len))
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
        sliding_window or 0, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=max(64 if block_d <= 64 else 32, block_size),
        WINDOWED=sliding_window is not None, UPCAST=interpreting(), IEEE=query.dtype == torch.float32, num_warps=4,
    )
    return out


def prefill_attention_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float, out: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain torch version of :func:`prefill_attention` (same arguments and result): row ``j`` of
    request ``i``'s chunk sees ``context_lens[i] - query_len + j + 1`` positions (the last
    ``sliding_window`` of them with a window), computed by
    :func:`weir.kernels.cpu_paged_attention.paged_attention_varlen_ref` in fp32. Slow; it is the
    oracle of the tests."""
    _check_args(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out)
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    rows, token_seq, token_ctx = [], [], []
    for i, n in enumerate(context_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        rows += range(s, e)
        token_seq += [i] * (e - s)
        token_ctx += range(n - (e - s) + 1, n + 1)
    if rows:
        rows = torch.tensor(rows, device=query.device)
        out[rows] = paged_attention_varlen_ref(query[rows], key_cache, value_cache, block_tables,
                                               torch.tensor(token_seq), torch.tensor(token_ctx), scale,
                                               sliding_window=sliding_window)
    return out
