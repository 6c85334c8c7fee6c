"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add before it.

``y = weight * (x / sqrt(mean(x ** 2) + eps))`` per row, computed in fp32 and rounded to the input
dtype before the weight multiply, as transformers' ``LlamaRMSNorm`` does. With ``residual`` the
kernel first forms ``s = x + residual`` (rounded to the input dtype, as an eager add would be),
returns it as the new residual and normalises it: one read of each input and one write of each
output instead of the three passes an add followed by a norm costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.kernels.common import FLOAT_DTYPES, check, check_tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, residual_out_ptr, weight_ptr, eps,
    stride_o, stride_x, stride_r, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (h * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x, weight, residual):
    check_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    check_tensor("weight", weight, 1, (x.dtype,), x.device)
    check(weight.shape[0] == x.shape[1], f"weight has {weight.shape[0]} entries for hidden size {x.shape[1]}")
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), x.device)
        check(residual.shape == x.shape, f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row (Triton), optionally after adding ``residual``.

    Args:
        x: ``[num_tokens, hidden_size]`` fp16/bf16/fp32, unit stride in ``hidden_size``.
        weight: ``[hidden_size]``, same dtype as ``x``.
        eps: added to the mean square.
        residual: optional ``[num_tokens, hidden_size]``, same dtype.

    Returns:
        ``y`` ``[num_tokens, hidden_size]`` in ``x``'s dtype; with ``residual``, the pair
        ``(y, x + residual)``.

    Raises:
        ValueError: a shape, dtype, device or stride does not match the above.
    """
    _check_args(x, weight, residual)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            out, x, residual if residual is not None else x, residual_out if residual is not None else out,
            weight, eps,
            out.stride(0), x.stride(0), residual.stride(0) if residual is not None else 0,
            residual_out.stride(0) if residual is not None else 0,
            HIDDEN=x.shape[1], BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 8),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of :func:`rms_norm` (same arguments and result), written as
    ``weir.engine.models.llama.RMSNorm`` computes it."""
    _check_args(x, weight, residual)
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    y = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
