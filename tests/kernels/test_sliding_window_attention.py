"""Sliding-window attention in the Triton decode and prefill kernels, against the torch reference
(which the CPU kernel's tests check against a band-masked SDPA): only the last ``W`` positions of
a query's context are seen, and block-table entries wholly before every query's window are never
read (they point at a NaN-filled block here, as a freed block's entry may name anything)."""

import pytest
import torch

from tests.kernels.support import assert_close, import_kernel, random_paged_cache

pa = import_kernel("paged_attention")
pf = import_kernel("prefill_attention")


def poison_before(bt, kc, vc, first_positions, block_size):
    """Append a NaN block to the caches and point each row's entries wholly before its
    ``first_positions[row]`` at it. Returns ``(bt, kc, vc)``."""
    nan = torch.full_like(kc[:, :1], float("nan"))
    kc, vc = torch.cat([kc, nan], 1), torch.cat([vc, nan], 1)
    bt = bt.clone()
    for row, first in enumerate(first_positions):
        bt[row, :first // block_size] = kc.shape[1] - 1
    return bt, kc, vc


@pytest.mark.parametrize("window", [1, 16, 20, 100])
def test_decode_with_a_window_matches_the_reference(device, window):
    lens = [0, 1, 15, 33, 65, 130]
    kc0, vc0, bt0 = random_paged_cache(lens, 2, 64, 16, torch.float16, device)
    bt, kc, vc = poison_before(bt0, kc0, vc0, [max(n - window, 0) for n in lens], 16)
    q = torch.randn(len(lens), 4, 64, generator=torch.Generator().manual_seed(3)).half().to(device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = pa.paged_attention_decode(q, kc, vc, bt, ctx, 0.125, sliding_window=window)
    want = pa.paged_attention_decode_ref(q, kc, vc, bt, ctx, 0.125, sliding_window=window)
    assert not want.isnan().any() and torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, want, torch.float16)
    if window < 130:  # the window changes what the longest context's query sees
        full = pa.paged_attention_decode_ref(q, kc0, vc0, bt0, ctx, 0.125)
        assert not torch.allclose(want[-1].float(), full[-1].float(), atol=1e-2)


# (cached prefix, new tokens): a fresh prompt longer than the window, chunks over a prefix longer
# than the window, a chunk of more than one query tile whose later rows see nothing in the
# first key tile (head_dim 128: 32-position key tiles)
CHUNKS = [(0, 40), (37, 5), (16, 16), (32, 70)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [5, 20])
def test_prefill_with_a_window_matches_the_reference(device, head_dim, window):
    ctx_lens = [p + n for p, n in CHUNKS]
    kc, vc, bt = random_paged_cache(ctx_lens, 1, head_dim, 16, torch.bfloat16, device)
    bt, kc, vc = poison_before(bt, kc, vc, [max(p - window + 1, 0) for p, _ in CHUNKS], 16)
    starts = [0]
    for _, n in CHUNKS:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 2, head_dim, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    loc = torch.tensor(starts, dtype=torch.int32, device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    max_q = max(n for _, n in CHUNKS)
    scale = head_dim ** -0.5
    out = pf.prefill_attention(q, kc, vc, bt, loc, ctx, max_q, scale, sliding_window=window)
    want = pf.prefill_attention_ref(q, kc, vc, bt, loc, ctx, max_q, scale, sliding_window=window)
    assert not want.isnan().any() and not out.isnan().any()
    assert_close(out, want, torch.bfloat16)


def test_a_window_below_one_is_refused(device):
    kc, vc, bt = random_paged_cache([5], 1, 64, 16, torch.float16, device)
    q = torch.randn(1, 1, 64).half().to(device)
    ctx = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
        pa.paged_attention_decode(q, kc, vc, bt, ctx, 0.125, sliding_window=0)
    loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got -1"):
        pf.prefill_attention(q, kc, vc, bt, loc, ctx, 1, 0.125, sliding_window=-1)


def test_a_row_that_sees_nothing_in_its_first_key_tile_keeps_its_true_maximum(device):
    # head_dim 128: 32-position key tiles; rows 36.. of the 64-row tile see nothing in the first.
    # Every score is about -340 (in nats): a running maximum clamped to 0 would underflow every
    # exponential to 0 and give zeros; the softmax is uniform over each row's 5 keys
    kc, vc, bt = random_paged_cache([102], 1, 128, 16, torch.bfloat16, device)
    kc = torch.full_like(kc, 3.0)
    q = torch.full((70, 1, 128), -10.0, dtype=torch.bfloat16, device=device)
    loc = torch.tensor([0, 70], dtype=torch.int32, device=device)
    ctx = torch.tensor([102], dtype=torch.int32, device=device)
    scale = 128 ** -0.5
    out = pf.prefill_attention(q, kc, vc, bt, loc, ctx, 70, scale, sliding_window=5)
    want = pf.prefill_attention_ref(q, kc, vc, bt, loc, ctx, 70, scale, sliding_window=5)
    assert want.abs().sum(-1).min() > 0
    assert_close(out, want, torch.bfloat16)
