"""Pieces shared by the kernels: argument checks for the wrappers, a ``tl.dot`` that also runs
under Triton's CPU interpreter, and the K/V tile loop of the two attention kernels
(:func:`attend_paged_context`).

The checks read shapes, dtypes and strides only, never tensor values, so a check costs no
host-device synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple, device: torch.device,
                 last_dim_contiguous: bool = True) -> None:
    """Raises ValueError unless ``t`` has ``ndim`` dimensions, one of ``dtypes``, lives on
    ``device`` and (when asked) has unit stride in its last dimension."""
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    check(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    check(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
    if last_dim_contiguous and t.numel():
        check(t.stride(-1) == 1, f"{name} needs unit stride in its last dimension, got {t.stride()}")


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, device: torch.device) -> None:
    """Both caches ``[num_kv_heads, num_blocks, block_size, head_dim]``, same shape and dtype;
    ``block_size`` a power of two >= 8."""
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES, device)
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES, device)
    check(key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype,
          f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
          f"{tuple(value_cache.shape)} {value_cache.dtype} differ")
    bs = key_cache.shape[2]
    check(bs >= 8 and bs & (bs - 1) == 0, f"block_size must be a power of two >= 8, got {bs}")


def check_attention_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         out: torch.Tensor | None) -> None:
    """The checks the decode and prefill wrappers share: ``query`` ``[num_tokens, num_heads,
    head_dim]`` in the caches' dtype, ``num_heads`` a multiple of the caches' ``num_kv_heads``,
    int32/int64 ``block_tables`` ``[num_seqs, max_num_blocks]`` and contiguous ``context_lens``
    ``[num_seqs]``, and ``out`` (when given) shaped and typed as ``query``. Raises ValueError."""
    dev = query.device
    check_tensor("query", query, 3, FLOAT_DTYPES, dev)
    check_kv_cache(key_cache, value_cache, dev)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, dev)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, dev)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    check(query.dtype == key_cache.dtype, f"query is {query.dtype} but the cache is {key_cache.dtype}")
    check(key_cache.shape[3] == head_dim,
          f"head_dim of query ({head_dim}) and cache ({key_cache.shape[3]}) differ")
    check(num_heads % num_kv_heads == 0,
          f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    check(block_tables.shape[0] == context_lens.shape[0],
          f"block_tables {tuple(block_tables.shape)} needs one row per entry of context_lens "
          f"{tuple(context_lens.shape)}")
    check(context_lens.stride(0) == 1, "context_lens must be contiguous")
    if out is not None:
        check_tensor("out", out, 3, (query.dtype,), dev)
        check(out.shape == query.shape, f"out {tuple(out.shape)} must match query {tuple(query.shape)}")


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation.

    ``UPCAST`` (set when interpreting): the CPU interpreter multiplies bf16 operands as their raw
    16-bit patterns, so the operands are widened to fp32 first; products of bf16/fp16 values are
    exact in fp32 either way. ``IEEE`` (set for fp32 operands): full fp32 products on the GPU
    instead of TF32, so fp32 inputs match the torch reference closely.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


LOG2_E = 1.4426950408889634


@triton.jit
def attend_paged_context(
    q, q_pos, k_base, v_base, block_table_ptr, kv_start, kv_len, window, scale_log2,
    stride_kb, stride_ks, stride_vb, stride_vs,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Attention of ``ROWS`` query rows to one request's paged context through one KV head: the
    K/V tile loop of the decode and the prefill kernels.

    Positions ``kv_start .. kv_len - 1`` are read in tiles of ``BLOCK_N`` (block-table entries
    before ``kv_start`` are never loaded: with a sliding window they may name freed blocks); each
    position finds its cache block through the block table (``block = table[pos // BLOCK_SIZE]``, offset
    ``pos % BLOCK_SIZE``), so a tile may span several blocks and end inside one (PagedAttention,
    Kwon et al. 2023). Per tile the scores update a running row maximum ``m``, a running sum ``l``
    of ``exp(s - m)`` and an unnormalised fp32 output, rescaled by ``exp(m_old - m_new)`` when the
    maximum grows; the division by ``l`` happens once, after the last tile (the online softmax of
    Milakov & Gimelshein 2018, in the form of FlashAttention-2: Dao 2023, "FlashAttention-2: Faster
    Attention with Better Parallelism and Work Partitioning", Algorithm 1). Scores are kept in log2
    units (``scale_log2 = scale * log2(e)``) so each exponential is one ``exp2``.

    Args:
        q: ``[ROWS, BLOCK_D]`` query rows (columns past ``HEAD_DIM`` zero).
        q_pos: ``[ROWS]`` (or one for all rows) context position of each row, read with
            ``CAUSAL`` (row ``r`` then sees positions ``<= q_pos[r]``) and ``WINDOWED``. Without
            ``WINDOWED`` every row must see the first position read (any causal row does), which
            keeps the running maximum finite from the first tile on; with it a row may see nothing
            in a tile, and its maximum stays -inf without producing NaN.
        k_base, v_base: this KV head's slice of the key and value caches.
        block_table_ptr: the request's row of the block table (int32 or int64 block ids).
        kv_start: the first context position read (0, or the first one inside any row's window).
        kv_len: one past the last context position read; ``kv_start >= kv_len`` reads none.
        window: with ``WINDOWED``, row ``r`` sees only positions ``> q_pos[r] - window`` (a sliding
            window of ``window`` positions ending at the row's own: transformers' convention).
        scale_log2: softmax scale times ``log2(e)``.
        stride_kb, stride_ks, stride_vb, stride_vs: block and slot strides of the caches.

    Returns:
        ``[ROWS, BLOCK_D]`` fp32 attention output; rows that saw no position are zero, not NaN.
    """
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(kv_start, kv_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < kv_len
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks + d[None, :],
                    mask=kv_mask, other=0.0)
        # s: [ROWS, BLOCK_N] fp32 scores in log2 units
        s = dot(q, tl.trans(k), UPCAST, IEEE) * scale_log2
        if CAUSAL:
            visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = p_mask[None, :]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if WINDOWED:  # a row that has seen nothing yet subtracts 0, not -inf (-inf - -inf is NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    # a row that saw nothing (kv_len 0: a padding row of a CUDA graph) gets zeros, not 0 / 0
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_i[:, None]
