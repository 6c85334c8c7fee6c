"""Layers shared by the decoder families of :mod:`weir.engine.models`: the two RMSNorm variants,
the rotary embedding and the gated MLP activations, in torch.

Each computes what transformers' model for its family computes, rounding where it rounds, so
greedy outputs match it token for token:

- :class:`RMSNorm` (Llama, Mistral, Qwen2, Qwen3): normalised in fp32, rounded to the input dtype,
  then times the weight. Its Triton twin is ``weir.kernels.rms_norm``.
- :class:`GemmaRMSNorm` (Gemma 3): normalised and multiplied by ``1 + weight`` in fp32, rounded
  once at the end.
- :func:`rope_cos_sin`: the rotary embedding's cos/sin tables, as transformers' rotary modules
  compute them; :func:`apply_rotary`: neox-layout rotary embedding (``weir.kernels.rotary`` is its
  kernel).
- :func:`silu_and_mul` (SwiGLU, ``weir.kernels.activation``) and :func:`gelu_tanh_and_mul`
  (GeGLU with the tanh approximation of GELU), each on a fused ``[gate | up]`` projection.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32, optionally after the
    residual add before it.

    With ``use_kernel`` (set by ``LlamaForCausalLM.use_kernels``) the add and the norm run as one
    Triton kernel (``weir.kernels.rms_norm``); otherwise in torch, with the same rounding (the sum
    is rounded to the input dtype before it is normalised).
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x ** 2) + eps) * (1 + weight)``, all in fp32 and rounded to
    the input dtype once at the end (Gemma Team 2024). The checkpoint stores ``weight`` centred on
    zero, so a zero weight is the identity scale. Optionally after the residual add before it.

    Always torch (no Triton kernel rounds this way); the ``use_kernels`` switch leaves it alone.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x``: ``[..., hidden_size]`` (the last dim is normalised). Returns the normalised rows in
        ``x``'s dtype, or with ``residual`` (same shape) the pair ``(norm(x + residual), x + residual)``,
        the sum rounded to the input dtype as an eager add is."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def rope_cos_sin(config, max_positions: int, dtype: torch.dtype, layer_type: Optional[str] = None):
    """The rotary embedding's tables for positions ``0 .. max_positions - 1``: ``(cos, sin)``, each
    ``[max_positions, head_dim]`` in ``dtype``, the values transformers' rotary modules
    (``LlamaRotaryEmbedding``, ``Gemma3RotaryEmbedding``) return for those positions.

    The inverse frequencies come from ``config.rope_parameters`` (of ``layer_type`` where a
    family keeps one set per layer type, as Gemma 3): ``rope_theta`` for the default type (Su et
    al. 2021), transformers' ``ROPE_INIT_FUNCTIONS`` for the scaled ones (``linear``, ``llama3``,
    ``yarn``, ...), whose attention factor scales both tables. Rope types whose frequencies depend
    on the current length (``dynamic``, ``longrope``) are refused earlier, when the config is
    checked (``weir.engine.loader``). transformers' modeling modules are not imported (about 2 s
    each on a small CPU).

    Raises:
        KeyError: the rope type is not one transformers knows.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            config, None, **({"layer_type": layer_type} if layer_type is not None else {}))
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.to(torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` -> ``[..., head_dim]``: the halves swapped, the new first half negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Torch rotary embedding (Su et al. 2021; neox layout, as transformers' Llama). ``qk``:
    ``[num_tokens, num_heads, head_dim]``; ``cos``/``sin``: each token's rows ``[num_tokens, 1,
    head_dim]``, gathered once per step by the model, so ``positions`` is not read here (the
    signature is ``weir.kernels.rotary.rotary_embedding``'s, which gathers the rows itself)."""
    return qk * cos + rotate_half(qk) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``[num_tokens, 2 * intermediate]`` (gate half first) ->
    ``[num_tokens, intermediate]``, ``silu(gate) * up``, as ``weir.kernels.activation.silu_and_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU (transformers'
    ``gelu_pytorch_tanh``): ``[num_tokens, 2 * intermediate]`` (gate half first) ->
    ``[num_tokens, intermediate]``, ``gelu_tanh(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
