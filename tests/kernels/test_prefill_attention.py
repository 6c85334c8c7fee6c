"""Prefill attention with a cached prefix: Triton kernel against the torch reference."""

import pytest
import torch

from tests.kernels.support import assert_close, import_kernel, random_paged_cache

pf = import_kernel("prefill_attention")

# (cached prefix, new tokens) per request: a whole prompt of one token, odd chunks, a chunk that
# ends on a block boundary, prefixes ending on and just past a boundary, more than one query tile
CHUNKS = [(0, 1), (0, 7), (16, 16), (17, 5), (3, 1), (32, 70)]


def packed(chunks, num_heads, head_dim, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    q_lens = [n for _, n in chunks]
    ctx = [p + n for p, n in chunks]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=g).to(dtype).to(device)
    loc = torch.tensor(starts, dtype=torch.int32, device=device)
    return q, loc, torch.tensor(ctx, dtype=torch.int32, device=device), max(q_lens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4, 8])
def test_prefill_matches_reference(device, dtype, head_dim, queries_per_kv):
    chunks = CHUNKS if queries_per_kv in (1, 4) else CHUNKS[:5]
    num_kv_heads = 2 if queries_per_kv == 1 else 1
    kc, vc, bt = random_paged_cache([p + n for p, n in chunks], num_kv_heads, head_dim, 16, dtype, device)
    q, loc, ctx, max_q = packed(chunks, num_kv_heads * queries_per_kv, head_dim, dtype, device)
    scale = head_dim ** -0.5
    out = pf.prefill_attention(q, kc, vc, bt, loc, ctx, max_q, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, pf.prefill_attention_ref(q, kc, vc, bt, loc, ctx, max_q, scale), dtype)


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_other_block_sizes(device, block_size):
    chunks = [(0, block_size + 1), (block_size, 3), (block_size - 1, 2 * block_size)]
    kc, vc, bt = random_paged_cache([p + n for p, n in chunks], 1, 64, block_size, torch.bfloat16, device)
    q, loc, ctx, max_q = packed(chunks, 3, 64, torch.bfloat16, device)
    out = pf.prefill_attention(q, kc, vc, bt.long(), loc.long(), ctx.long(), max_q, 0.125)
    assert_close(out, pf.prefill_attention_ref(q, kc, vc, bt, loc, ctx, max_q, 0.125), torch.bfloat16)


def test_prefill_rows_after_a_decode_offset_are_the_only_ones_written(device):
    # in a packed step the prefill rows follow the decode rows: query_start_loc starts past them
    chunks = [(4, 3), (0, 2)]
    kc, vc, bt = random_paged_cache([7, 2], 1, 64, 16, torch.float16, device)
    q = torch.randn(2 + 5, 2, 64).half().to(device)
    loc = torch.tensor([2, 5, 7], dtype=torch.int32, device=device)
    ctx = torch.tensor([7, 2], dtype=torch.int32, device=device)
    out = torch.full_like(q, 7.0)
    pf.prefill_attention(q, kc, vc, bt, loc, ctx, 3, 0.125, out=out)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    want = pf.prefill_attention_ref(q, kc, vc, bt, loc, ctx, 3, 0.125, out=torch.full_like(q, 7.0))
    assert_close(out, want, torch.float16)


def test_prefill_without_prefix_equals_plain_causal_attention(device):
    kc, vc, bt = random_paged_cache([20], 1, 64, 16, torch.float32, device)
    q, loc, ctx, max_q = packed([(0, 20)], 2, 64, torch.float32, device)
    out = pf.prefill_attention(q, kc, vc, bt, loc, ctx, max_q, 0.125)
    k = kc[0, bt[0, :2].long()].reshape(-1, 64)[:20]
    v = vc[0, bt[0, :2].long()].reshape(-1, 64)[:20]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.expand(2, 20, 64), v.expand(2, 20, 64), is_causal=True, scale=0.125)
    assert_close(out, want.transpose(0, 1), torch.float32)


def test_prefill_rejects_bad_arguments(device):
    kc, vc, bt = random_paged_cache([4], 1, 64, 16, torch.float16, device)
    q, loc, ctx, max_q = packed([(0, 4)], 2, 64, torch.float16, device)
    with pytest.raises(ValueError, match="query_start_loc"):
        pf.prefill_attention(q, kc, vc, bt, loc[:1], ctx, max_q, 0.125)
    with pytest.raises(ValueError, match="cache is torch.float16"):
        pf.prefill_attention(q.float(), kc, vc, bt, loc, ctx, max_q, 0.125)
