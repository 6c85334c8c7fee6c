"""SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up`` from the fused
gate/up projection, as vLLM's ``SiluAndMul``.

``silu(g) = g / (1 + exp(-g))``. The torch form (``split``, ``F.silu``, ``*``) is two kernels and an
intermediate tensor; here one program reads a slice of a row's gate and up halves and writes the
product. The rounding follows eager torch: ``silu(gate)`` is computed in fp32 and rounded to the
input dtype, then multiplied by ``up`` in fp32 and rounded again. ``exp`` is the CUDA math
library's (libdevice) on the GPU and numpy's under the interpreter, so results agree with
:func:`silu_and_mul_ref` to within one rounding of the dtype, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from weir.kernels.common import FLOAT_DTYPES, check, check_tensor, interpreting


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, stride_o, stride_x,
    D: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # LIBDEVICE (GPU): the accurate expf torch's own kernel calls, not tl.exp's ex2.approx; the
    # interpreter has no libdevice
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(gate.dtype)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x):
    check_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    check(x.shape[1] % 2 == 0, f"x must have an even number of columns (gate, up), got {x.shape[1]}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` with ``d = x.shape[1] // 2`` (Triton).

    Args:
        x: ``[num_tokens, 2 * d]`` fp16/bf16/fp32, the gate half first (the output of a fused
            gate/up projection), unit stride in its last dimension.

    Returns:
        ``[num_tokens, d]`` in ``x``'s dtype, contiguous.

    Raises:
        ValueError: ``x`` is not 2-D float with an even number of unit-stride columns.
    """
    _check_args(x)
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            out, x, out.stride(0), x.stride(0),
            D=d, BLOCK=block, LIBDEVICE=not interpreting(), num_warps=min(max(block // 256, 1), 4),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch version of :func:`silu_and_mul` (same argument and result), written as
    ``weir.engine.models.llama`` computes it."""
    _check_args(x)
    gate, up = x.split(x.shape[1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up
