"""Gemma 3 text decoder (``gemma3_text``, and the language model of ``gemma3`` checkpoints) on the
paged KV cache.

Architecture (Gemma Team 2025, "Gemma 3 Technical Report"): the Qwen3 block of
:mod:`weir.engine.models.qwen3` (per-head q_norm/k_norm before rotary) with these changes, each
as transformers' ``Gemma3ForCausalLM`` computes it:

- every norm is :class:`~weir.engine.models.layers.GemmaRMSNorm` (``1 + weight``, in fp32);
- four norms per block: input, post-attention (on the attention output, before the residual
  add), pre- and post-feed-forward (the latter on the MLP output, before the residual add);
- the MLP is GeGLU (``gelu_pytorch_tanh``);
- the embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the weight dtype first;
- attention scale ``query_pre_attn_scalar ** -0.5``;
- ``layer_types`` interleaves ``sliding_attention`` layers (window ``sliding_window``) with
  ``full_attention`` ones, each kind with its own RoPE table (``rope_parameters[layer_type]``:
  base 10k local, 1M global, and the global one possibly scaled);
- the logits are soft-capped, ``cap * tanh(logits / cap)``, when ``final_logit_softcapping`` is set;
- the LM head is tied to the embeddings unless the config says otherwise.

With the Triton backend only the rotary embedding runs as its kernel; the Gemma norms and GeGLU
stay in torch (no kernel of ``weir.kernels`` rounds as they do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weir.engine.models.layers import GemmaRMSNorm, apply_rotary, gelu_tanh_and_mul, rope_cos_sin
from weir.engine.models.llama import LlamaForCausalLM
from weir.engine.models.qwen3 import Qwen3DecoderLayer
from weir.engine.models.sliding_window import LAYER_TYPES, layer_sliding_windows

# the activation Gemma 3's GeGLU is written for (transformers' name)
HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
# prefixes of the language model's weights in a gemma3 (image and text) checkpoint: transformers 5's
# Gemma3ForConditionalGeneration, and the layout earlier checkpoints were saved with
MULTIMODAL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
# weights of a gemma3 checkpoint the text decoder has no use for
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def check_gemma3_config(config) -> None:
    """Refuse, with one line naming the config key, what the Gemma 3 block cannot honour.

    Raises:
        ValueError: ``hidden_activation`` other than ``gelu_pytorch_tanh``, ``attention_bias`` set
            (Gemma's o_proj would need a bias too), a ``query_pre_attn_scalar`` that is not a
            positive number, ``rope_parameters`` lacking a layer type's entry, or what
            :func:`~weir.engine.models.sliding_window.layer_sliding_windows` refuses.
    """
    layer_sliding_windows(config)  # unknown layer types first: each needs its RoPE entry below
    act = getattr(config, "hidden_activation", HIDDEN_ACTIVATION)
    if act != HIDDEN_ACTIVATION:
        raise ValueError(f"hidden_activation={act!r} is not supported: weir's Gemma 3 MLP is GeGLU with "
                         f"{HIDDEN_ACTIVATION!r}")
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported for gemma3: weir's Gemma 3 attention has no biases")
    scalar = config.query_pre_attn_scalar
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar={scalar!r} is not a positive number")
    rope = getattr(config, "rope_parameters", None) or {}
    for layer_type in sorted(set(config.layer_types)):
        if not isinstance(rope.get(layer_type), dict):
            raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers")


class Gemma3DecoderLayer(Qwen3DecoderLayer):
    """The Qwen3 block with Gemma's norms, scale, GeGLU and its layer type's RoPE table
    (``rope_table``: an index into the model's stacked tables, set by the model)."""

    norm_class = GemmaRMSNorm

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config, dtype)
        h = config.hidden_size
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, config.rms_norm_eps, dtype)
        self.act = gelu_tanh_and_mul
        self.rope_table = 0

    def pre_attention(self, x, residual, positions, cos, sin):
        """As :meth:`LlamaDecoderLayer.pre_attention`, with ``cos``/``sin`` holding every table
        stacked on a leading dim: ``[num_tables, num_tokens, 1, head_dim]`` (torch) or
        ``[num_tables, max_positions, head_dim]`` (kernel); this layer reads its own."""
        return super().pre_attention(x, residual, positions, cos[self.rope_table], sin[self.rope_table])

    def post_attention(self, o, residual):
        """o_proj and post-attention norm, the residual add inside the pre-feed-forward norm, GeGLU
        and the post-feed-forward norm. ``o``: ``[num_tokens, num_heads, head_dim]``. Returns
        ``(mlp_output, residual)``, each ``[num_tokens, hidden]``."""
        t = o.shape[0]
        # o: [num_tokens, num_heads * head_dim]
        h = self.post_attention_layernorm(self.o_proj(o.reshape(t, -1)))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.down_proj(self.act(self.gate_up_proj(h)))), residual

    def use_kernels(self, enabled: bool) -> None:
        """Only the rotary embedding has a Triton kernel that computes what Gemma computes."""
        if enabled:
            from weir.kernels.rotary import rotary_embedding as rotary
        else:
            rotary = apply_rotary
        self.rotary = rotary


class Gemma3ForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with :class:`Gemma3DecoderLayer` blocks, the scaled embedding, one
    RoPE table per layer type and logit soft-capping; weights named as in transformers'
    ``Gemma3ForCausalLM`` (or its ``Gemma3ForConditionalGeneration``, whose vision weights are skipped).

    Args:
        config: a transformers ``Gemma3TextConfig``.
        dtype: weight and activation dtype.
        max_positions: RoPE table length (>= max_model_len).

    Raises:
        ValueError: :func:`check_gemma3_config`, or a window the engine cannot honour
            (:func:`~weir.engine.models.sliding_window.layer_sliding_windows`).
    """

    decoder_layer = Gemma3DecoderLayer

    def __init__(self, config, dtype: torch.dtype, max_positions: int):
        check_gemma3_config(config)
        super().__init__(config, dtype, max_positions)
        for layer, layer_type in zip(self.layers, config.layer_types):
            layer.rope_table = LAYER_TYPES.index(layer_type)
        # sqrt(hidden_size) rounded to the weight dtype, as transformers scales its embeddings
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(dtype), persistent=False)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def _build_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        # one table per layer type, each with its rope_parameters (local base 10k, global 1M, a
        # scaled global rope where the config has one), as transformers' Gemma 3 rotary module
        present = [t for t in LAYER_TYPES
                   if t in self.config.layer_types and self.config.rope_parameters.get(t) is not None]
        tables = {t: rope_cos_sin(self.config, max_positions, dtype, layer_type=t) for t in present}
        # a kind no layer has is never read: it repeats one that is there
        tables = [tables.get(t, tables[present[0]]) for t in LAYER_TYPES]
        # cos/sin: [len(LAYER_TYPES), max_positions, head_dim], indexed by each layer's rope_table
        self.register_buffer("cos_cache", torch.stack([c for c, _ in tables]).contiguous(), persistent=False)
        self.register_buffer("sin_cache", torch.stack([s for _, s in tables]).contiguous(), persistent=False)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Scaled token embeddings ``[num_tokens, hidden_size]`` and every RoPE table's rows for the
        positions, cos and sin ``[len(LAYER_TYPES), num_tokens, 1, head_dim]``, or with the kernels on
        the whole stacked tables ``[len(LAYER_TYPES), max_positions, head_dim]``."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        if self.kernels_enabled:
            return x, self.cos_cache, self.sin_cache
        # cos/sin: [num_tables, num_tokens, 1, head_dim], broadcast over heads
        cos = self.cos_cache[:, positions].unsqueeze(2)
        sin = self.sin_cache[:, positions].unsqueeze(2)
        return x, cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` logits in fp32, soft-capped in the model dtype
        (as transformers caps them) when ``final_logit_softcapping`` is set."""
        logits = F.linear(hidden, self.lm_head_weight)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`; a gemma3 (image and text) checkpoint's language
        model weights are renamed to the text model's and its vision weights skipped."""
        super().load_weights(self._language_model_weights(weights))

    @staticmethod
    def _language_model_weights(weights):
        for name, tensor in weights:
            if name.startswith(VISION_PREFIXES):
                continue
            for prefix, text_prefix in MULTIMODAL_PREFIXES:
                if name.startswith(prefix):
                    name = text_prefix + name[len(prefix):]
                    break
            yield name, tensor

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> None:
        """As :meth:`LlamaForCausalLM.init_dummy`, with every norm weight 0 (a scale of 1)."""
        super().init_dummy(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.zero_()
