"""Helpers of the kernel tests: importing a kernel module, random paged caches."""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def import_kernel(name: str):
    """Import ``weir.kernels.<name>``; without Triton skip the module on a developer machine and fail
    in CI (``CI`` set), so a green CI run always means the kernels ran."""
    try:
        return importlib.import_module(f"weir.kernels.{name}")
    except ImportError as exc:
        message = f"weir.kernels.{name} needs Triton: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)


def random_paged_cache(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random key/value caches ``[num_kv_heads, num_blocks, block_size, head_dim]`` and a block
    table ``[num_seqs, max_num_blocks]`` int32 giving each request its own shuffled blocks
    (padding entries point at block 0, which also holds real data, so a read past a context
    shows up as a wrong result)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(need) + 3
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need + [1])
    rows = []
    for n in need:
        rows.append(order[:n] + [0] * (width - n))
        order = order[n:]
    block_tables = torch.tensor(rows, dtype=torch.int32, device=device)
    return key_cache, value_cache, block_tables


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Kernel output against the fp32 reference: a few units in the last place of ``dtype``."""
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def truncate_fp32_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded toward zero to bf16 precision (the low 16 bits dropped), still fp32:
    how Triton's CPU interpreter converts fp32 to bf16, where a GPU rounds to nearest even."""
    return (x.view(torch.int32) & -65536).view(torch.float32)  # -65536: 0xFFFF0000


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (common) dtype lie between each pair, as int64."""
    bits = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
            torch.bfloat16: (torch.int16, 0x7FFF)}
    int_dtype, magnitude = bits[actual.dtype]

    def ordered(t):  # sign-magnitude bits -> integers in the order of the values
        i = t.contiguous().view(int_dtype).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(actual) - ordered(expected)).abs()
