"""SwiGLU (silu(gate) * up): Triton kernel against the torch reference."""

import pytest
import torch

from tests.kernels.support import import_kernel, truncate_fp32_to_bf16, ulp_distance

act = import_kernel("activation")


def reference(x):
    """The reference in the kernel's order of roundings; for bf16 under the CPU interpreter, whose
    fp32 -> bf16 cast truncates, with truncation in place of both roundings."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        gate, up = x.float().chunk(2, dim=-1)
        silu = truncate_fp32_to_bf16(torch.nn.functional.silu(gate))
        return truncate_fp32_to_bf16(silu * up).to(torch.bfloat16)
    return act.silu_and_mul_ref(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [64, 96, 1536, 2100])  # 1536, 2100: several column blocks
def test_silu_and_mul_matches_reference(device, dtype, intermediate):
    g = torch.Generator().manual_seed(0)
    # a strided view, as a slice of a wider matmul output would be
    x = (4 * torch.randn(5, 2 * intermediate + 8, generator=g)).to(dtype).to(device)[:, :2 * intermediate]
    got = act.silu_and_mul(x)
    want = reference(x)
    assert got.dtype == dtype and got.shape == (5, intermediate) and got.is_contiguous()
    # exp is not torch's (libdevice on the GPU, numpy's under the interpreter): it differs in the
    # last fp32 place, which now and then moves the rounding of silu(gate) to fp16/bf16 by one unit
    ulps = ulp_distance(got, want)
    if dtype == torch.float32:
        assert ulps.max() <= 4
    else:
        assert ulps.max() <= 2 and (ulps == 0).float().mean() >= 0.99, ulps.float().mean()


def test_silu_and_mul_takes_gate_first(device):
    x = torch.tensor([[0.0, 2.0, 5.0, 7.0]], device=device)  # gate [0, 2], up [5, 7]
    got = act.silu_and_mul(x)
    torch.testing.assert_close(got, torch.tensor([[0.0, 7 * 2 / (1 + torch.exp(torch.tensor(-2.0)).item())]],
                                                 device=device))


def test_silu_and_mul_of_no_tokens_is_empty(device):
    assert act.silu_and_mul(torch.zeros(0, 8, device=device)).shape == (0, 4)


@pytest.mark.parametrize("bad", ["odd", "ndim", "stride", "int"])
def test_silu_and_mul_rejects_bad_arguments(device, bad):
    x = {"odd": torch.zeros(2, 7), "ndim": torch.zeros(2, 2, 8), "stride": torch.zeros(2, 16)[:, ::2],
         "int": torch.zeros(2, 8, dtype=torch.int32)}[bad].to(device)
    with pytest.raises(ValueError):
        act.silu_and_mul(x)
