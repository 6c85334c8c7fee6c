"""The CPU paged-attention kernel against its torch reference, over a grid of small shapes."""

import pytest
import torch

from weir.kernels.cpu_paged_attention import (
    is_available,
    paged_attention_varlen,
    paged_attention_varlen_ref,
)
from tests.kernels.support import random_paged_cache
from tests.support import _missing_service


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    if not is_available():
        _missing_service("the CPU attention kernel could not be built (no C compiler?)")


def make_case(contexts, num_kv_heads, group, head_dim, block_size, seed=0):
    """Random caches and one sequence per context length with shuffled block ids; every token of
    the sequence's last ``min(3, ctx)`` positions is a query (a prefill chunk over its prefix)."""
    kc, vc, bt = random_paged_cache(contexts, num_kv_heads, head_dim, block_size, torch.float32,
                                    torch.device("cpu"), seed)
    token_seq, token_ctx = [], []
    for i, c in enumerate(contexts):
        for pos in range(max(c - 3, 0), c):
            token_seq.append(i)
            token_ctx.append(pos + 1)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(token_seq), num_kv_heads * group, head_dim, generator=g)
    return q, kc, vc, bt.long(), torch.tensor(token_seq), torch.tensor(token_ctx)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_reference(head_dim, group, block_size):
    contexts = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size, 37]
    q, kc, vc, bt, seq, ctx = make_case(contexts, 2, group, head_dim, block_size, seed=head_dim + group)
    scale = head_dim ** -0.5
    got = paged_attention_varlen(q, kc, vc, bt, seq, ctx, scale)
    want = paged_attention_varlen_ref(q, kc, vc, bt, seq, ctx, scale)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_context_of_one_returns_that_value():
    q, kc, vc, bt, seq, ctx = make_case([1], 1, 2, 16, 16)
    out = paged_attention_varlen(q, kc, vc, bt, seq, ctx, 0.25)
    block = int(bt[0, 0])
    # one visible key: softmax weight 1, the output is the value row itself for both query heads
    torch.testing.assert_close(out[0], vc[0, block, 0].expand(2, 16), atol=0, rtol=0)


def test_bad_inputs_raise():
    q, kc, vc, bt, seq, ctx = make_case([5], 2, 2, 16, 16)
    with pytest.raises(TypeError, match="float32"):
        paged_attention_varlen(q.double(), kc, vc, bt, seq, ctx, 1.0)
    with pytest.raises(TypeError, match="token_seq must be int64"):
        paged_attention_varlen(q, kc, vc, bt, seq.int(), ctx, 1.0)
    with pytest.raises(ValueError, match="does not fit cache"):
        paged_attention_varlen(q[:, :3], kc, vc, bt, seq, ctx, 1.0)
    with pytest.raises(ValueError, match="token_seq and token_ctx must be"):
        paged_attention_varlen(q, kc, vc, bt, seq[:1], ctx, 1.0)


def test_reference_is_causal_attention_and_zero_without_context():
    # the oracle of every attention kernel against torch's SDPA: a 20-token sequence over 3 blocks,
    # each token a query over its own prefix, 2 query heads on 1 KV head; then one row seeing nothing
    kc, vc, bt = random_paged_cache([20], 1, 16, 8, torch.float32, torch.device("cpu"), seed=3)
    q = torch.randn(21, 2, 16, generator=torch.Generator().manual_seed(4))
    seq = torch.zeros(21, dtype=torch.int64)
    ctx = torch.tensor(list(range(1, 21)) + [0])
    got = paged_attention_varlen_ref(q, kc, vc, bt, seq, ctx, 0.25)
    k = kc[0, bt[0, :3].long()].reshape(-1, 16)[:20]
    v = vc[0, bt[0, :3].long()].reshape(-1, 16)[:20]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:20].transpose(0, 1), k.expand(2, 20, 16), v.expand(2, 20, 16), is_causal=True, scale=0.25)
    torch.testing.assert_close(got[:20], want.transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[20], torch.zeros(2, 16))


def band_attention(q, k, v, window, scale):
    """SDPA of every position of one sequence over keys ``(p - window, p]``: ``q`` ``[n, heads,
    dim]``, ``k``/``v`` ``[n, dim]`` of one KV head. The mask is built here, not taken from the
    code under test."""
    n = q.shape[0]
    pos = torch.arange(n)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    heads = q.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.expand(heads, n, -1), v.expand(heads, n, -1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def poison_blocks_before_windows(kc, vc, bt, token_seq, token_ctx, window, block_size):
    """A copy of ``bt`` whose entries before the first block any of a sequence's tokens needs
    point at the caches' last block, filled with NaN here, so that reading one shows up as NaN."""
    nan_block = kc.shape[1] - 1
    kc[:, nan_block] = float("nan")
    vc[:, nan_block] = float("nan")
    bt = bt.clone()
    for s in range(bt.shape[0]):
        ctxs = [int(c) for t, c in zip(token_seq.tolist(), token_ctx.tolist()) if t == s]
        first_needed = max(min(ctxs) - window, 0) // block_size
        bt[s, :first_needed] = nan_block
    return bt


@pytest.mark.parametrize("window", [1, 5, 16, 20, 100])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sliding_window_matches_reference_and_band_mask(window, block_size):
    contexts = [1, 7, block_size, block_size + 1, 3 * block_size + 5, 45]
    q, kc, vc, bt, seq, ctx = make_case(contexts, 2, 2, 16, block_size, seed=window)
    got = paged_attention_varlen(q, kc, vc, bt, seq, ctx, 0.25, sliding_window=window)
    want = paged_attention_varlen_ref(q, kc, vc, bt, seq, ctx, 0.25, sliding_window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window < 45:  # the window changes the result of the longest context
        full = paged_attention_varlen_ref(q, kc, vc, bt, seq, ctx, 0.25)
        assert not torch.allclose(want[-1], full[-1], atol=1e-3)


def test_sliding_window_reference_is_a_band_mask():
    # a 45-token sequence, every position a query, window 20: rows equal SDPA with the band mask
    kc, vc, bt = random_paged_cache([45], 1, 16, 8, torch.float32, torch.device("cpu"), seed=5)
    q = torch.randn(45, 2, 16, generator=torch.Generator().manual_seed(6))
    seq, ctx = torch.zeros(45, dtype=torch.int64), torch.arange(1, 46)
    k = kc[0, bt[0, :6].long()].reshape(-1, 16)[:45]
    v = vc[0, bt[0, :6].long()].reshape(-1, 16)[:45]
    want = band_attention(q, k, v, 20, 0.25)
    for fn in (paged_attention_varlen, paged_attention_varlen_ref):
        torch.testing.assert_close(fn(q, kc, vc, bt.long(), seq, ctx, 0.25, sliding_window=20), want,
                                   atol=1e-5, rtol=1e-5)


def test_sliding_window_never_reads_blocks_before_the_window():
    # blocks wholly before every query's window point at a NaN block: the output stays finite
    block_size, window = 8, 10
    q, kc, vc, bt, seq, ctx = make_case([40, 29], 2, 2, 16, block_size, seed=7)
    kc = torch.cat([kc, torch.zeros_like(kc[:, :1])], 1)
    vc = torch.cat([vc, torch.zeros_like(vc[:, :1])], 1)
    clean = paged_attention_varlen_ref(q, kc, vc, bt, seq, ctx, 0.25, sliding_window=window)
    poisoned = poison_blocks_before_windows(kc, vc, bt, seq, ctx, window, block_size)
    assert poisoned[0, :3].tolist() == [kc.shape[1] - 1] * 3  # contexts 38..40: blocks 0-2 unused
    for fn in (paged_attention_varlen, paged_attention_varlen_ref):
        got = fn(q, kc, vc, poisoned, seq, ctx, 0.25, sliding_window=window)
        torch.testing.assert_close(got, clean, atol=1e-5, rtol=1e-5)
    # without the window the poisoned blocks are read
    assert paged_attention_varlen(q, kc, vc, poisoned, seq, ctx, 0.25).isnan().any()


def test_sliding_window_below_one_is_refused():
    q, kc, vc, bt, seq, ctx = make_case([5], 1, 1, 16, 8)
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
        paged_attention_varlen(q, kc, vc, bt, seq, ctx, 1.0, sliding_window=0)
