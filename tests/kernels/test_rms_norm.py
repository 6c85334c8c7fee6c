"""RMSNorm (+ residual): Triton kernel against the torch reference."""

import pytest
import torch

from tests.kernels.support import assert_close, import_kernel

rn = import_kernel("rms_norm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 576, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    r = torch.randn(5, hidden, generator=g).to(dtype).to(device) if with_residual else None
    got = rn.rms_norm(x, w, 1e-5, residual=r)
    want = rn.rms_norm_ref(x, w, 1e-5, residual=r)
    if with_residual:
        # one rounding of the sum either way (the CPU interpreter may truncate bf16 instead)
        assert_close(got[1], want[1], dtype)
        got, want = got[0], want[0]
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_rms_norm_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(torch.zeros(2, 64, device=device), torch.ones(32, device=device), 1e-5)
