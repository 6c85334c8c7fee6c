"""Rotary position embedding (Su et al. 2021, "RoFormer"), neox layout, on queries and keys at once.

Each head vector ``x`` of a token at position ``p`` becomes ``x * cos[p] + rotate_half(x) * sin[p]``
with ``rotate_half(x) = cat(-x[half:], x[:half])``: the layout of transformers' Llama
(``apply_rotary_pos_emb``) and vLLM's ``is_neox_style``. The torch form of that line is five
elementwise kernels plus a gather of ``cos``/``sin`` per step; here one program per token reads the
token's position, its rows of the tables and all its heads, and writes the result in place.

Numerics: the kernel rounds where eager torch does (each product to the input dtype, then their
sum), with no fused multiply-add, so on a GPU it is bit-identical to :func:`rotary_embedding_ref`
in fp32, fp16 and bf16. Triton's CPU interpreter converts fp32 to bf16 by truncation, so there bf16
results may differ from torch in the last place; fp32 and fp16 stay bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.kernels.common import FLOAT_DTYPES, INDEX_DTYPES, check, check_tensor

# compiler options of every launch: with fp fusion on, LLVM turns the rounded products and their
# sum into fma instructions (even in bf16: fma.rn.bf16), which round once where torch rounds twice
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rotary_kernel(
    qk_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_t, stride_h, stride_c, stride_s,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    mask = (h < NUM_HEADS)[:, None] & d_mask[None, :]
    # x1, x2: [BLOCK_H, BLOCK_HALF], the two halves of every head of this token
    first = qk_ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    # both halves of each table row are read: HF tables repeat them, but nothing here relies on it
    c1 = tl.load(cos_ptr + pos * stride_c + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_c + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_s + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_s + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # eager torch's order: x * cos and rotate_half(x) * sin each rounded, then their sum
    o1 = (f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)
    o2 = (f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)
    tl.store(first, o1.to(dtype), mask=mask)
    tl.store(first + HALF, o2.to(dtype), mask=mask)


def _check_args(qk, positions, cos_cache, sin_cache):
    dev = qk.device
    check_tensor("qk", qk, 3, FLOAT_DTYPES, dev)
    check_tensor("positions", positions, 1, INDEX_DTYPES, dev)
    check_tensor("cos_cache", cos_cache, 2, (qk.dtype,), dev)
    check_tensor("sin_cache", sin_cache, 2, (qk.dtype,), dev)
    head_dim = qk.shape[2]
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    check(positions.shape[0] == qk.shape[0],
          f"positions has {positions.shape[0]} entries for {qk.shape[0]} tokens")
    check(positions.numel() == 0 or positions.stride(0) == 1, "positions must be contiguous")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check(table.shape[1] == head_dim,
              f"{name} {tuple(table.shape)} needs head_dim={head_dim} columns")
    check(cos_cache.shape == sin_cache.shape,
          f"cos_cache {tuple(cos_cache.shape)} and sin_cache {tuple(sin_cache.shape)} differ")


def rotary_embedding(qk: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate every head of every token by its position (Triton), in place.

    Args:
        qk: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, ``head_dim`` even and of unit
            stride; any token and head strides (the query+key part of a fused qkv projection,
            ``[num_tokens, num_q_heads + num_kv_heads, head_dim]``, is the intended input).
        positions: ``[num_tokens]`` int32/int64, contiguous; each must be below ``max_positions``
            (not checked: reading the values would synchronise with the device).
        cos_cache, sin_cache: ``[max_positions, head_dim]`` in ``qk``'s dtype, unit column stride:
            the model's tables, gathered by position inside the kernel.

    Returns:
        ``qk`` itself, rotated.

    Raises:
        ValueError: a shape, dtype, device or stride does not match the above.
    """
    _check_args(qk, positions, cos_cache, sin_cache)
    num_tokens, num_heads, head_dim = qk.shape
    if num_tokens == 0 or num_heads == 0:
        return qk
    half = head_dim // 2
    block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        qk, positions, cos_cache, sin_cache,
        qk.stride(0), qk.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        NUM_HEADS=num_heads, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=min(max(block_h * block_half // 256, 1), 8), **LAUNCH_OPTIONS,
    )
    return qk


def rotary_embedding_ref(qk: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor) -> torch.Tensor:
    """Plain torch version of :func:`rotary_embedding` (same arguments; returns a new tensor and
    leaves ``qk`` alone), written as ``weir.engine.models.llama`` computes it."""
    _check_args(qk, positions, cos_cache, sin_cache)
    # cos, sin: [num_tokens, 1, head_dim], broadcast over heads
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
