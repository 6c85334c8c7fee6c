"""Scatter new keys/values into the paged KV cache (vLLM calls this ``reshape_and_cache``).

A token's slot is ``block_id * block_size + offset``; slot -1 marks a token whose key/value is not
stored (a padding row of a CUDA-graph batch). One program copies one (token, KV head) row of
``head_dim`` values into each cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.kernels.common import FLOAT_DTYPES, check, check_kv_cache, check_tensor


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kch, stride_kcb, stride_kcs, stride_vch, stride_vcb, stride_vcs,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # int64 ids: head * stride_kch passes 2**31 with a cache of a few tens of GB per layer
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    if slot >= 0:
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + head * stride_kch + block * stride_kcb + offset * stride_kcs + d,
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + head * stride_vch + block * stride_vcb + offset * stride_vcs + d,
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_args(key, value, key_cache, value_cache, slot_mapping):
    dev = key.device
    check_tensor("key", key, 3, FLOAT_DTYPES, dev)
    check_tensor("value", value, 3, FLOAT_DTYPES, dev)
    check_kv_cache(key_cache, value_cache, dev)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), dev)
    check(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    check(key.shape[1:] == (key_cache.shape[0], key_cache.shape[3]),
          f"key {tuple(key.shape)} does not match the cache's [num_kv_heads, head_dim] "
          f"({key_cache.shape[0]}, {key_cache.shape[3]})")
    check(slot_mapping.shape[0] == key.shape[0],
          f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's key/value rows at its slot (Triton); -1 skips the token.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, unit stride in ``head_dim`` (a view
            into a fused qkv projection is fine); cast to the cache dtype on store.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``, written in
            place; ``block_size`` a power of two >= 8.
        slot_mapping: ``[num_tokens]`` int64/int32 slot per token, or -1.

    Raises:
        ValueError: a shape, dtype, device or stride does not match the above.
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[2],
        num_warps=1,
    )


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch version of :func:`write_kv_cache` (same arguments and effect)."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    kvh, _, _, hd = key_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # caches viewed as [num_kv_heads, num_slots, head_dim]; rows: [kept_tokens, num_kv_heads, head_dim]
    key_cache.view(kvh, -1, hd).index_copy_(1, slots, key[keep].transpose(0, 1).to(key_cache.dtype))
    value_cache.view(kvh, -1, hd).index_copy_(1, slots, value[keep].transpose(0, 1).to(value_cache.dtype))
