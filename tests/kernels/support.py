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
