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
