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

from weir.engine.models.layers import RMSNorm, apply_rotary, rope_cos_sin, silu_and_mul
from weir.engine.models.sliding_window import layer_sliding_windows


class LlamaDecoderLayer(nn.Module):
    """One block: its weights (q/k/v and gate/up fused), norms and sliding window (set by the
    model). A family that differs in a part overrides that part's method."""

    # the RMSNorm variant of every norm of the block (and the model's final norm)
    norm_class = RMSNorm

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
        self.input_layernorm = self.norm_class(h, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_class(h, config.rms_norm_eps, dtype)
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
        qk = self.rotary(self.query_key_heads(qkv), positions, cos, sin)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k = qk[:, :nq], qk[:, nq:]
        v = qkv[:, (nq + nkv) * self.head_dim:].view(t, nkv, self.head_dim)
        return q, k, v, residual

    def query_key_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The queries and keys of the q/k/v projection ``[num_tokens, q_size + 2 * kv_size]`` as
        heads, before rotary: ``[num_tokens, num_heads + num_kv_heads, head_dim]`` (a view here; a
        family that normalises each head, as Qwen3, overrides it)."""
        n = self.num_heads + self.num_kv_heads
        return qkv[:, :n * self.head_dim].view(qkv.shape[0], n, self.head_dim)

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

    def use_kernels(self, enabled: bool) -> None:
        """Run rotary and SwiGLU as their Triton kernels (``weir.kernels.rotary``,
        ``.activation``), or in torch. Importing the kernels needs Triton."""
        if enabled:
            from weir.kernels.activation import silu_and_mul as act
            from weir.kernels.rotary import rotary_embedding as rotary
        else:
            act, rotary = silu_and_mul, apply_rotary
        self.rotary, self.act = rotary, act


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

    # the block class; a family that differs only inside its blocks sets its own
    decoder_layer = LlamaDecoderLayer

    def __init__(self, config, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [self.decoder_layer(config, dtype) for _ in range(config.num_hidden_layers)]
        )
        # per layer: its sliding window in tokens, or None (global); the KV cache manager reads it
        self.sliding_windows = layer_sliding_windows(config)
        for layer, window in zip(self.layers, self.sliding_windows):
            layer.sliding_window = window
        self.norm = self.decoder_layer.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self._build_rope(max_positions, dtype)
        self.kernels_enabled = False

    def _build_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        # the tables transformers' rotary module computes (every rope_type: default, llama3,
        # linear, yarn ...), cos/sin: [max_positions, head_dim]
        cos, sin = rope_cos_sin(self.config, max_positions, dtype)
        self.register_buffer("cos_cache", cos.contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin.contiguous(), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def use_kernels(self, enabled: bool) -> None:
        """Run every residual add + RMSNorm, rotary embedding and SwiGLU as its Triton kernel
        (``weir.kernels.rms_norm``, ``.rotary``, ``.activation``: the Triton backend's choice,
        ``model_kernels``), or in torch. Importing the kernels needs Triton."""
        self.kernels_enabled = enabled
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.use_kernel = enabled
        for layer in self.layers:
            layer.use_kernels(enabled)

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

    # checkpoint names (transformers') of the pieces stacked into one fused parameter:
    # (fused name, checkpoint name, shard index); shard i starts after the sizes of shards < i
    stacked_params = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """Copy weights named as in transformers' ``*ForCausalLM`` state dict into this model, one
        tensor at a time (as vLLM's ``load_weights``): each is cast to the parameter's dtype and moved
        to its device once, q/k/v and gate/up into their slices of the fused projections, so the
        caller can stream them from the files without holding a second copy of the model.

        Args:
            weights: an iterable of ``(name, tensor)``, e.g. ``state_dict.items()`` or
                :func:`weir.engine.weight_loader.iter_weights`.

        Raises:
            KeyError: a weight the architecture needs is missing, or a name it has no parameter for
                (other than rotary tables some checkpoints store, and a tied LM head).
            ValueError: a tensor whose shape differs from its parameter's (slice).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue  # rotary tables some checkpoints store; a tied head is the embedding
            target, key = self._param_slice(name, params)
            if target is None:
                raise KeyError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(key)
        missing = sorted(set(self._expected_weight_keys(params)) - loaded)
        if missing:
            raise KeyError(f"checkpoint has no weight {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def _param_slice(self, name: str, params: dict[str, torch.Tensor]):
        """The parameter (or slice of a fused one) a checkpoint weight goes to, and the key that
        marks it loaded: ``(tensor, key)``, or ``(None, None)`` when nothing here takes it."""
        local = name[len("model."):] if name.startswith("model.") else name
        for fused, piece, shard in self.stacked_params:
            marker = f".{piece}."
            if marker not in local:
                continue
            fused_name = local.replace(marker, f".{fused}.").replace("self_attn.", "").replace("mlp.", "")
            param = params.get(fused_name)
            if param is None:
                return None, None
            layer = self.layers[int(local.split(".")[1])]
            sizes = layer.qkv_sizes if fused == "qkv_proj" else (layer.intermediate_size,) * 2
            start = sum(sizes[:shard])
            return param.narrow(0, start, sizes[shard]), name
        local = local.replace("self_attn.", "").replace("mlp.", "")
        param = params.get(local)
        return (param, name) if param is not None else (None, None)

    def _expected_weight_keys(self, params: dict[str, torch.Tensor]):
        """The checkpoint names this model needs, one per parameter or fused slice."""
        for pname, param in params.items():
            parts = pname.split(".")
            if parts[0] == "layers":
                prefix, leaf, kind = ".".join(parts[:2]), parts[2], parts[3]
                pieces = [piece for fused, piece, _ in self.stacked_params if fused == leaf]
                for piece in pieces or [leaf]:
                    group = "self_attn" if piece in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") else (
                        "mlp" if piece in ("gate_proj", "up_proj", "down_proj") else None)
                    mid = f"{group}.{piece}" if group else piece
                    yield f"model.{prefix}.{mid}.{kind}"
            elif pname == "lm_head.weight":
                yield pname
            else:
                yield f"model.{pname}"

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> None:
        """Random weights (normal, std 0.02; norms 1) for benchmarks without a checkpoint."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm: layer, final, q_norm/k_norm
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
