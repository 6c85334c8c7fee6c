"""Attention over the paged KV cache, one backend per device, chosen once at start-up.

The KV cache of one layer is ``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major, so
that a request's gathered context is ``[num_kv_heads, seq_len, head_dim]`` with each head
contiguous: attention reads it without a transpose copy). A token's *slot* is
``block_id * block_size + offset``; a request's context is read through its block table.

Every backend has the same interface:

- ``index_dtype``: the dtype of the step's integer inputs (``weir.engine.step_inputs``);
- ``model_kernels``: whether the model's residual add + RMSNorm, rotary embedding and SwiGLU run
  as the Triton kernels of ``weir.kernels`` (``LlamaForCausalLM.use_kernels``);
- ``build_metadata(StepInputs)``: once per step, whatever the backend derives from the step's
  common fields (masks, per-token rows, views);
- ``write_kv(key, value, key_cache, value_cache, metadata)`` and
  ``forward(query, key, value, key_cache, value_cache, metadata, scale, sliding_window=None)``:
  once per layer. ``sliding_window`` is the layer's: None for global attention, or ``W >= 1``, and
  then the query at position ``p`` sees the keys at ``p - W + 1 .. p`` (transformers' sliding-window
  convention, Mistral's and Gemma 3's alike). Block-table entries of blocks wholly before every
  query's window are never read: the KV cache manager may have freed those blocks (their entries
  then hold ``weir.engine.block_pool.NULL_BLOCK_ID``).
"""

from __future__ import annotations

import torch

from weir.engine.attention.cpu_backend import CpuAttentionBackend
from weir.engine.attention.torch_backend import TorchAttentionBackend
from weir.engine.attention.triton_backend import TritonAttentionBackend

AttentionBackend = TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend

BACKENDS = {b.name: b for b in (TorchAttentionBackend, CpuAttentionBackend, TritonAttentionBackend)}


def select_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The Triton kernels on CUDA in fp16/bf16; the C kernel on CPU in float32 when it builds
    (a C compiler is found); the torch reference everywhere else."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return TritonAttentionBackend()
    if device.type == "cpu" and dtype == torch.float32:
        from weir.kernels.cpu_paged_attention import is_available

        if is_available():
            return CpuAttentionBackend()
    return TorchAttentionBackend()


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (``torch``, ``cpu`` or ``triton``).

    Raises:
        ValueError: no backend has that name.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "CpuAttentionBackend", "TorchAttentionBackend", "TritonAttentionBackend",
           "get_attention_backend", "select_attention_backend"]
