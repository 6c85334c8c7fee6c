"""The K/V tile loop shared by the decode and prefill kernels (``common.attend_paged_context``):
a decode is a one-token prefill, so both kernels must give the reference's answer on the same
requests, across tile and block boundaries and with grouped-query heads."""

import inspect
import re

import pytest
import torch

from tests.kernels.support import assert_close, import_kernel, random_paged_cache

pa = import_kernel("paged_attention")
pf = import_kernel("prefill_attention")

# tiles are 64 positions (32 for the prefill kernel at head_dim 128): lengths on both sides of one,
# two and more tiles, none of them (but 32, 64) a multiple of the tile; 0 is a decode padding row
CONTEXT_LENS = [0, 1, 31, 32, 33, 63, 64, 65, 100, 129]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_and_one_token_prefill_agree_with_the_reference(device, dtype, head_dim, block_size):
    num_kv_heads, queries_per_kv = 2, 4
    kc, vc, bt = random_paged_cache(CONTEXT_LENS, num_kv_heads, head_dim, block_size, dtype, device)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(CONTEXT_LENS), num_kv_heads * queries_per_kv, head_dim, generator=g)
    q = q.to(dtype).to(device)
    ctx = torch.tensor(CONTEXT_LENS, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    want = pa.paged_attention_decode_ref(q, kc, vc, bt, ctx, scale)
    decode = pa.paged_attention_decode(q, kc, vc, bt, ctx, scale)
    assert torch.equal(decode[0], torch.zeros_like(decode[0]))
    assert_close(decode, want, dtype)

    # the same requests as one-token prefill chunks (the empty request left out: a chunk has >= 1 token)
    # query_start_loc: one row per request, num_seqs + 1 = len(CONTEXT_LENS) entries
    loc = torch.arange(len(CONTEXT_LENS), dtype=torch.int32, device=device)
    prefill = pf.prefill_attention(q[1:], kc, vc, bt[1:], loc, ctx[1:], 1, scale)
    assert_close(prefill, want[1:], dtype)
    # the two references are one: the same rows give the same bits
    assert torch.equal(pf.prefill_attention_ref(q[1:], kc, vc, bt[1:], loc, ctx[1:], 1, scale), want[1:])


def test_both_kernels_run_the_shared_loop():
    for kernel in (pa._paged_decode_kernel, pf._prefill_kernel):
        source = inspect.getsource(kernel.fn)
        assert "attend_paged_context(" in source
        # the loop, its online softmax and the final division live only in the shared function
        assert not re.search(r"^\s*for\s", source, re.M)
        assert "exp2" not in source and "l_i" not in source
