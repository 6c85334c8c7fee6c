"""Qwen3 decoder on the paged KV cache.

The Llama block of :mod:`weir.engine.models.llama` with one change (Qwen team 2025, "Qwen3
Technical Report"): each head's query and key are RMS-normalised (``q_norm``/``k_norm``, weights
``[head_dim]``) before the rotary embedding. ``head_dim`` is read from the config, q/k/v carry a
bias only with ``attention_bias``, and sliding windows come from ``layer_types`` as for Qwen2.
"""

from __future__ import annotations

import torch

from weir.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.q_norm = self.norm_class(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = self.norm_class(self.head_dim, config.rms_norm_eps, dtype)

    def query_key_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaDecoderLayer.query_key_heads`, each query and key head normalised on its
        own (q_norm, k_norm) before rotary: ``[num_tokens, num_heads + num_kv_heads, head_dim]``."""
        t, d = qkv.shape[0], self.head_dim
        nq, nkv = self.num_heads, self.num_kv_heads
        # each head's row normalised on its own: q: [num_tokens * num_heads, head_dim]
        q = self.q_norm(qkv[:, :nq * d].reshape(t * nq, d))
        k = self.k_norm(qkv[:, nq * d:(nq + nkv) * d].reshape(t * nkv, d))
        return torch.cat((q.view(t, nq, d), k.view(t, nkv, d)), dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with :class:`Qwen3DecoderLayer` blocks; same interface, weights
    named as in transformers' ``Qwen3ForCausalLM``."""

    decoder_layer = Qwen3DecoderLayer
