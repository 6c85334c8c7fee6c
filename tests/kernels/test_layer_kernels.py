"""How many kernels one decoder layer, and one step of a one-layer model, launch on the Triton
path (aten ops that compute plus Triton launches, counted on CPU under the interpreter by
``bench.kernel_count``), exactly.

Before the rotary and SwiGLU kernels (95ed8dc) the same counts were 16 and 20: rotary as mul, neg,
cat, mul, mul, add, SwiGLU as silu, mul, and per step the two gathers of cos/sin. What is left are
the four projections (one matmul each, with the gate/up and q/k/v fused) and one Triton kernel per
other op.
"""

import pytest
import torch

from bench.kernel_count import count_ops
from tests.kernels.support import import_kernel

import_kernel("rotary")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts the CPU-interpreter run")

LAYER_KERNELS = {
    "aten.linear": 4,  # qkv, o, gate_up, down
    "triton._rms_norm_kernel": 2,  # residual add + input norm, residual add + post-attention norm
    "triton._rotary_kernel": 1,  # queries and keys, cos/sin gathered inside
    "triton._write_kv_kernel": 1,
    "triton._paged_decode_kernel": 1,  # the step has a decode ...
    "triton._prefill_kernel": 1,  # ... and prefill chunks
    "triton._silu_and_mul_kernel": 1,
}


# the layer's, with a plain input norm, plus the embedding and the final norm: no cos/sin gathers
STEP_KERNELS = {**LAYER_KERNELS, "aten.embedding": 1, "triton._rms_norm_kernel": 3}


def test_one_decoder_layer_launches_eleven_kernels_and_a_step_thirteen():
    ops = count_ops()
    assert ops["layer"]["kernels"] == LAYER_KERNELS
    assert sum(ops["layer"]["kernels"].values()) == 11
    assert ops["step"]["kernels"] == STEP_KERNELS
    assert sum(ops["step"]["kernels"].values()) == 13
