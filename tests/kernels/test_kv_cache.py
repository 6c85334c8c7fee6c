"""KV-cache write: Triton kernel against the torch reference."""

import pytest
import torch

from tests.kernels.support import import_kernel

kv = import_kernel("kv_cache")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_matches_reference_and_skips_minus_one(device, dtype, head_dim, block_size):
    g = torch.Generator().manual_seed(0)
    num_kv_heads, num_blocks = 3, 5
    # slots: first and last of a block, block boundaries, one skipped token
    slots = [0, block_size - 1, block_size, -1, 3 * block_size + 2, num_blocks * block_size - 1]
    qkv = torch.randn(len(slots), 5 * num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    # key/value as strided views into a fused projection, as the model produces them
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2)]
    want = [c.clone() for c in caches]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    kv.write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    kv.write_kv_cache_ref(key, value, want[0], want[1], slot_mapping)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    # the reference itself: token 4 landed at block 3, offset 2
    assert torch.equal(want[0][:, 3, 2], key[4])
    assert torch.equal(want[1][:, 3, 2], value[4])


def test_write_rejects_mismatched_heads(device):
    cache = torch.zeros(2, 4, 16, 64, device=device)
    key = torch.zeros(3, 4, 64, device=device)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv.write_kv_cache(key, key, cache, cache.clone(), torch.zeros(3, dtype=torch.long, device=device))
