"""Pieces shared by the kernels: argument checks for the wrappers and a ``tl.dot`` that also runs
under Triton's CPU interpreter.

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
