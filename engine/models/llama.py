"""Llama-family decoder (Llama, Mistral, Qwen2) running on the paged KV cache.

Architecture (Touvron et al. 2023, "LLaMA"): token embedding, N blocks of
RMSNorm -> grouped-query self-attention with rotary position embeddings -> residual ->
RMSNorm -> SwiGLU MLP -> residual, a final RMSNorm and a tied or untied LM head. Qwen2 adds biases
to the q/k/v projections. The numerics follow transformers' ``LlamaForCausalLM`` (RMSNorm in fp32,
RoPE tables from transformers' own rotary module) so greedy outputs match it token for token.

q/k/v and gate/up projections are fused into one matmul each; each residual add is done inside the
norm after it. With :meth:`LlamaForCausalLM.use_kernels` (the Triton backend's choice) the add+norm,
the rotary embedding of queries and keys, and SwiGLU each run as one Triton kernel of
``weir.kernels``, rounding where the torch ops here do (rotary: bit-identical on the GPU; SwiGLU:
within a unit in the last place, its ``exp`` not being torch's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weir.engine.models.sliding_window import layer_sliding_windows


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32, optionally after the
    residual add before it.

    With ``use_kernel`` (set by :meth:`LlamaForCausalLM.use_kernels`) the add and the norm
    run as one Triton kernel (``weir.kernels.rms_norm``); otherwise in torch, with the same
    rounding (the sum is rounded to the input dtype before it is normalised).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.use_kernel = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x``: ``[num_tokens, hidden_size]``. Returns the normalised rows, or with ``residual``
        (same shape) the pair ``(norm(x + residual), x + residual)``."""
        if self.use_kernel:
            from weir.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused pass, same values as the three-step form below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Torch rotary embedding (neox layout, as transformers' Llama). ``qk``: ``[num_tokens,
    num_heads, head_dim]``; ``cos``/``sin``: each token's rows ``[num_tokens, 1, head_dim]``,
    gathered once per step by the model, so ``positions`` is not read here (the signature is
    ``weir.kernels.rotary.rotary_embedding``'s, which gathers the rows itself)."""
    return qk * cos + rotate_half(qk) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch SwiGLU: ``[num_tokens, 2 * intermediate]`` (gate half first) -> ``[num_tokens,
    intermediate]``, as ``weir.kernels.activation.silu_and_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        self.scale = self.head_dim ** -0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, h, bias=False, dtype=dtype)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False, dtype=dtype)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        # the torch ops, or the Triton kernels once LlamaForCausalLM.use_kernels(True) swaps them in
        self.rotary = apply_rotary
        self.act = silu_and_mul
        self.sliding_window: int | None = None  # the model sets it from the config; None: global

    def forward(self, x, residual, positions, cos, sin, key_cache, value_cache, attn_backend,
                attn_metadata):
        """One block. ``x``: ``[num_tokens, hidden]``, the previous block's MLP output (or the
        embeddings, with ``residual`` None); ``residual``: the stream before it; ``positions``:
        ``[num_tokens]``; cos/sin: what ``self.rotary`` reads, each token's rows ``[num_tokens, 1,
        head_dim]`` (torch) or the whole tables ``[max_positions, head_dim]`` (kernel). Returns
        ``(mlp_output, residual)``: their sum is the block's output, added inside the next norm.

        Three parts, which piecewise CUDA graphs (``weir.engine.piecewise_graphs``) cut at the
        attention call: :meth:`pre_attention`, :meth:`attention`, :meth:`post_attention`."""
        q, k, v, residual = self.pre_attention(x, residual, positions, cos, sin)
        o = self.attention(q, k, v, key_cache, value_cache, attn_backend, attn_metadata)
        return self.post_attention(o, residual)

    def pre_attention(self, x, residual, positions, cos, sin):
        """Input norm (after the residual add), q/k/v projection and rotary (``positions``, cos and
        sin as in :meth:`forward`). Returns ``(q, k, v, residual)``: q ``[num_tokens, num_heads,
        head_dim]``, k and v ``[num_tokens, num_kv_heads, head_dim]`` (views into the projection),
        residual ``[num_tokens, hidden]``."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        qkv = self.qkv_proj(h)
        t = x.shape[0]
        nq, nkv = self.num_heads, self.num_kv_heads
        # rotary on queries and keys in one pass. qk: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = qkv[:, :(nq + nkv) * self.head_dim].view(t, nq + nkv, self.head_dim)
        qk = self.rotary(qk, positions, cos, sin)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k = qk[:, :nq], qk[:, nq:]
        v = qkv[:, (nq + nkv) * self.head_dim:].view(t, nkv, self.head_dim)
        return q, k, v, residual

    def attention(self, q, k, v, key_cache, value_cache, attn_backend, attn_metadata):
        """Write the new keys/values to the cache, then attend. Returns
        ``[num_tokens, num_heads, head_dim]``."""
        attn_backend.write_kv(k, v, key_cache, value_cache, attn_metadata)
        return attn_backend.forward(q, k, v, key_cache, value_cache, attn_metadata, self.scale,
                                    sliding_window=self.sliding_window)

    def post_attention(self, o, residual):
        """o_proj, post-attention norm (after the residual add) and the SwiGLU MLP. ``o``:
        ``[num_tokens, num_heads, head_dim]``. Returns ``(mlp_output, residual)``."""
        t = o.shape[0]
        h, residual = self.post_attention_layernorm(self.o_proj(o.reshape(t, -1)), residual)
        return self.down_proj(self.act(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Owns its weights and RoPE tables, not the KV cache.

    Args:
        config: a transformers ``LlamaConfig``/``MistralConfig``/``Qwen2Config``.
        dtype: weight and activation dtype.
        max_positions: RoPE table length (>= max_model_len).

    Raises:
        ValueError: the config asks for a sliding window the engine cannot honour
            (:func:`~weir.engine.models.sliding_window.layer_sliding_windows`).
    """

    def __init__(self, config, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)]
        )
        # per layer: its sliding window in tokens, or None (global); the KV cache manager reads it
        self.sliding_windows = layer_sliding_windows(config)
        for layer, window in zip(self.layers, self.sliding_windows):
            layer.sliding_window = window
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self._build_rope(max_positions, dtype)
        self.kernels_enabled = False

    def _build_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        # transformers' rotary module computes the same tables as its own model uses
        # (every rope_type: default, llama3, linear, dynamic, yarn ...)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(self.config)
        pos = torch.arange(max_positions).unsqueeze(0)
        cos, sin = rope(torch.empty(1, dtype=dtype), pos)
        # cos/sin: [max_positions, head_dim]
        self.register_buffer("cos_cache", cos[0].contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin[0].contiguous(), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def use_kernels(self, enabled: bool) -> None:
        """Run every residual add + RMSNorm, rotary embedding and SwiGLU as its Triton kernel
        (``weir.kernels.rms_norm``, ``.rotary``, ``.activation``: the Triton backend's choice,
        ``model_kernels``), or in torch. Importing the kernels needs Triton."""
        self.kernels_enabled = enabled
        if enabled:
            from weir.kernels.activation import silu_and_mul as act
            from weir.kernels.rotary import rotary_embedding as rotary
        else:
            act, rotary = silu_and_mul, apply_rotary
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.use_kernel = enabled
            elif isinstance(m, LlamaDecoderLayer):
                m.rotary, m.act = rotary, act

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, attn_backend,
                attn_metadata) -> torch.Tensor:
        """Run one packed step.

        Args:
            input_ids: ``[num_tokens]`` int32/int64.
            positions: ``[num_tokens]`` int32/int64 position of each token in its request.
            kv_caches: per layer a ``(key_cache, value_cache)`` pair, each
                ``[num_kv_heads, num_blocks, block_size, head_dim]``.
            attn_backend: a backend of ``weir.engine.attention``.
            attn_metadata: what ``attn_backend.build_metadata`` made of the step's inputs.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).
        """
        x, cos, sin = self.embed(input_ids, positions)
        residual = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cos, sin, kc, vc, attn_backend, attn_metadata)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings ``[num_tokens, hidden_size]`` and what the layers' rotary reads: each
        position's rows of the tables, cos and sin ``[num_tokens, 1, head_dim]``, or with the
        kernels on the whole tables ``[max_positions, head_dim]`` (the rotary kernel gathers them)."""
        x = self.embed_tokens(input_ids)
        if self.kernels_enabled:
            return x, self.cos_cache, self.sin_cache
        # cos/sin: [num_tokens, 1, head_dim], broadcast over heads
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return x, cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` logits in fp32."""
        return F.linear(hidden, self.lm_head_weight).float()

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' ``*ForCausalLM`` state dict, fusing q/k/v and gate/up.

        Raises:
            KeyError: a weight the architecture needs is missing.
        """
        def get(name):
            if name not in sd:
                raise KeyError(f"checkpoint has no weight {name!r}")
            return sd[name]

        self.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
        self.norm.weight.copy_(get("model.norm.weight"))
        if not self.tie_word_embeddings:
            self.lm_head.weight.copy_(get("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.qkv_proj.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            layer.o_proj.weight.copy_(get(p + "self_attn.o_proj.weight"))
            layer.gate_up_proj.weight.copy_(
                torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            )
            layer.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> None:
        """Random weights (normal, std 0.02; norms 1) for benchmarks without a checkpoint."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
