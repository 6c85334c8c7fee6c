"""Decode paged attention: Triton kernel against the torch reference."""

import pytest
import torch

from tests.kernels.support import assert_close, import_kernel, random_paged_cache

pa = import_kernel("paged_attention")

# context = 1, odd lengths, both sides of block boundaries, more than one 64-position tile
CONTEXT_LENS = [1, 7, 16, 17, 33, 64, 65, 130]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4, 8])
def test_decode_matches_reference(device, dtype, head_dim, queries_per_kv):
    num_kv_heads = 2 if queries_per_kv < 8 else 1
    kc, vc, bt = random_paged_cache(CONTEXT_LENS, num_kv_heads, head_dim, 16, dtype, device)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(CONTEXT_LENS), num_kv_heads * queries_per_kv, head_dim, generator=g)
    q = q.to(dtype).to(device)
    ctx = torch.tensor(CONTEXT_LENS, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = pa.paged_attention_decode(q, kc, vc, bt, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, pa.paged_attention_decode_ref(q, kc, vc, bt, ctx, scale), dtype)


@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_other_block_sizes(device, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    kc, vc, bt = random_paged_cache(lens, 2, 64, block_size, torch.bfloat16, device)
    q = torch.randn(len(lens), 8, 64).to(torch.bfloat16).to(device)
    ctx = torch.tensor(lens, dtype=torch.int64, device=device)
    out = pa.paged_attention_decode(q, kc, vc, bt.long(), ctx, 0.125)
    assert_close(out, pa.paged_attention_decode_ref(q, kc, vc, bt, ctx, 0.125), torch.bfloat16)


def test_decode_zero_context_gives_zeros_and_out_is_filled_in_place(device):
    kc, vc, bt = random_paged_cache([5, 1], 1, 64, 16, torch.float16, device)
    q = torch.randn(2, 4, 64).half().to(device)
    ctx = torch.tensor([5, 0], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    ret = pa.paged_attention_decode(q, kc, vc, bt, ctx, 0.125, out=out)
    assert ret is out
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, pa.paged_attention_decode_ref(q, kc, vc, bt, ctx, 0.125), torch.float16)


def test_decode_single_key_returns_its_value(device):
    # with one context position the softmax weight is exactly 1
    kc, vc, bt = random_paged_cache([1], 1, 64, 16, torch.float16, device)
    q = torch.randn(1, 3, 64).half().to(device)
    out = pa.paged_attention_decode(q, kc, vc, bt, torch.tensor([1], device=device), 0.125)
    block = int(bt[0, 0])
    assert torch.equal(out[0], vc[0, block, 0].expand(3, 64))


@pytest.mark.parametrize("bad", ["dtype", "heads", "block_size", "stride", "rows"])
def test_decode_rejects_bad_arguments(device, bad):
    kc, vc, bt = random_paged_cache([4], 2, 64, 16, torch.float16, device)
    q = torch.randn(1, 4, 64).half().to(device)
    ctx = torch.tensor([4], dtype=torch.int32, device=device)
    if bad == "dtype":
        q = q.bfloat16()
    elif bad == "heads":
        q = torch.randn(1, 3, 64).half().to(device)
    elif bad == "block_size":
        kc, vc = kc[:, :, :12], vc[:, :, :12]
    elif bad == "stride":
        q = torch.randn(1, 4, 128).half().to(device)[:, :, ::2]
    elif bad == "rows":
        ctx = torch.tensor([4, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError):
        pa.paged_attention_decode(q, kc, vc, bt, ctx, 0.125)
