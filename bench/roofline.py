"""Roofline for the benchmarks: the machine's measured matmul rate, and the one model of a
workload's FLOPs and least memory traffic that every benchmark uses.

Each benchmark measures :func:`matmul_peak` in its own run, counts the model math its systems did
with a :class:`FlopCounter` (:func:`generation_flops` for generation), and prints the achieved
GFLOP/s and its fraction of the measured peak; ``bench.mixed`` also bounds the run by
:func:`generation_bytes` over the measured copy bandwidth.

FLOP counting (multiply-add = 2 FLOPs), for a decoder of the Llama family:

- every computed token: ``2 * non_embedding_params`` (attention projections, MLP, norms);
- every row whose logits are computed: ``2 * hidden_size * vocab_size`` (lm_head);
- attention: a query at position ``p`` (0-based) reads ``p + 1`` keys, costing
  ``4 * num_heads * head_dim * (p + 1)`` per layer (``Q K^T`` and ``P V``).

Embedding lookups, softmax, RoPE and activations are not counted (no matmul work).

Least bytes moved by generation (:func:`generation_bytes`): the weights are read once per decode
step, and there are at least as many steps as the longest output; every token's key and value are
written once; a decode token reads its whole context's keys and values, and a prompt's keys and
values are read once more by its prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that fix its FLOPs per token."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a transformers config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim,
                   config.intermediate_size, config.vocab_size)

    @property
    def non_embedding_params(self) -> int:
        """Weights every token passes through: per layer q/k/v/o, gate/up/down and two norms, plus
        the final norm. Biases (Qwen2's q/k/v) are left out: they cost no multiplies."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * h) + h

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights one forward pass reads: the non-embedding weights and the lm_head."""
        return (self.non_embedding_params + self.hidden_size * self.vocab_size) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of one token's keys and values over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def flops_per_token(self) -> int:
        return 2 * self.non_embedding_params

    @property
    def flops_per_logit_row(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops(self, start: int, num_tokens: int) -> int:
        """Attention FLOPs of queries at positions ``start .. start + num_tokens - 1`` (causal)."""
        # sum of (p + 1) for p in [start, start + num_tokens)
        keys = num_tokens * start + num_tokens * (num_tokens + 1) // 2
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys


class FlopCounter:
    """Adds up the model FLOPs of the spans a system computed.

    ``add_span(start, n)`` counts ``n`` tokens at positions ``start..start+n-1`` whose keys and
    values were computed (or read from cache) for positions before ``start``; ``add_logits(rows)``
    counts lm_head rows.
    """

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self.num_tokens = 0
        self.num_logit_rows = 0
        self.attention = 0

    def add_span(self, start: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.num_tokens += num_tokens
        self.attention += self.shape.attention_flops(start, num_tokens)

    def add_logits(self, num_rows: int) -> None:
        self.num_logit_rows += num_rows

    @property
    def flops(self) -> int:
        s = self.shape
        return self.num_tokens * s.flops_per_token + self.num_logit_rows * s.flops_per_logit_row + self.attention


def _time_matmul(a: torch.Tensor, b: torch.Tensor, min_time_s: float) -> float:
    """Best GFLOP/s of ``a @ b`` over rounds of at least ``min_time_s / 4`` each."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    torch.matmul(a, b, out=out)  # warm-up
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    reps = max(1, int(1e8 // flops))
    best, spent = 0.0, 0.0
    while spent < min_time_s:
        if a.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        if a.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, flops * reps / dt / 1e9)
        if dt < min_time_s / 4:
            reps *= 2
    return best


def matmul_shapes(shape: ModelShape, num_tokens: int = 512) -> dict[str, tuple[int, int, int]]:
    """``name -> (m, k, n)``: the model's linear layers on ``num_tokens`` rows, and a big square."""
    h, d = shape.hidden_size, shape.head_dim
    return {
        "q_proj/o_proj": (num_tokens, h, shape.num_heads * d),
        "k_proj/v_proj": (num_tokens, h, shape.num_kv_heads * d),
        "gate/up_proj": (num_tokens, h, shape.intermediate_size),
        "down_proj": (num_tokens, shape.intermediate_size, h),
        "lm_head": (num_tokens, h, shape.vocab_size),
        "square 2048": (2048, 2048, 2048),
    }


def matmul_peak(shape: ModelShape, dtype: torch.dtype = torch.float32, device: str = "cpu",
                num_tokens: int = 512, min_time_s: float = 0.5) -> dict[str, float]:
    """Measured ``torch.matmul`` GFLOP/s for each shape of :func:`matmul_shapes`, and ``"peak"``:
    the best of them (the best sustained rate this machine showed in this run)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rates = {}
    for name, (m, k, n) in matmul_shapes(shape, num_tokens).items():
        a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
        rates[name] = _time_matmul(a, b, min_time_s)
    rates["peak"] = max(rates.values())
    return rates


def format_rate(system: str, flops: int, seconds: float, peak_gflops: float) -> str:
    """One report line: achieved GFLOP/s of model math and its fraction of the measured peak."""
    rate = flops / seconds / 1e9
    return (f"{system:<24} model math {flops / 1e9:>10.1f} GFLOP {rate:>8.1f} GFLOP/s "
            f"{rate / peak_gflops:>6.1%} of measured matmul peak")


def generation_flops(shape: ModelShape, requests) -> FlopCounter:
    """Model FLOPs of generation requests, each ``(num_prompt_tokens, num_cached_tokens,
    num_output_tokens)``: the prompt from its first uncached token, then every output token but the
    last fed back one at a time (decode); one logits row per output token. Pass only useful output
    tokens (up to EOS) and 0 cached tokens to count a system's useful work."""
    fc = FlopCounter(shape)
    for num_prompt, num_cached, num_out in requests:
        fc.add_span(num_cached, num_prompt - num_cached)
        fc.add_span(num_prompt, num_out - 1)
        fc.add_logits(num_out)
    return fc


def generation_bytes(shape: ModelShape, requests, dtype_bytes: int) -> int:
    """Least bytes a generation workload moves (module docstring), each request
    ``(num_prompt_tokens, num_output_tokens)``."""
    kv_bytes = 0
    for num_prompt, num_out in requests:
        num_computed = num_prompt + num_out - 1  # tokens that pass through the model
        # contexts read by the num_out - 1 decode tokens, at positions num_prompt .. num_computed - 1
        decode_context = sum(range(num_prompt + 1, num_computed + 1))
        kv_bytes += shape.kv_bytes_per_token(dtype_bytes) * (num_computed + num_prompt + decode_context)
    num_steps = max(num_out for _, num_out in requests)
    return shape.weight_bytes(dtype_bytes) * num_steps + kv_bytes
