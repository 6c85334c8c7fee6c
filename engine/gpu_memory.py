"""KV-cache size on a GPU: what is left after the weights and a profiled activation peak.

The peak is measured, not estimated: one dummy step of ``max_num_batched_tokens`` prefill tokens
(the largest step the scheduler can build) runs through the model, then logits and a log-softmax
for ``max_num_seqs`` rows, and the allocator's high-water mark above the weights is the activation
peak. The cache gets ``gpu_memory_utilization`` of the free memory minus that peak and minus the
CUDA-graph reserve; the rest is headroom for cuBLAS workspaces and fragmentation (the scheme of
vLLM's ``determine_num_available_blocks``).

CUDA graphs are captured after the cache is allocated (the full decode graphs record its
addresses), so their memory pool is reserved here by an estimate rather than measured: one more
dummy forward of the largest captured token count, whose activation peak bounds the pool (a graph
pool holds the temporaries of its largest capture, reused by every smaller one, and a piece's
temporaries are a subset of the eager forward's). The capture logs what it really took.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from weir.engine.attention import AttentionBackend, select_attention_backend
from weir.engine.scheduler import ScheduledRequest, SchedulerOutput
from weir.engine.step_inputs import build_step_inputs

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class _ProfilePrompt:
    """What the step builder reads of a request: a fresh prompt whose blocks are all block 0."""

    all_token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0


@torch.inference_mode()
def dummy_step(model, attn_backend: AttentionBackend, kv_caches, num_tokens: int, num_sampled: int,
               max_model_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The largest step the scheduler can build: ``num_tokens`` prompt tokens in prompts of at
    most ``max_model_len - 1`` tokens, then logits and a log-softmax of ``num_sampled`` rows.

    The step is built by the engine's own step builder and run on ``attn_backend``, with every
    slot -1: nothing is written to ``kv_caches`` (per layer a ``(key_cache, value_cache)`` pair;
    any number of blocks, the block tables point at block 0 only).

    Returns:
        ``[min(num_sampled, num_tokens)]`` int64 argmax tokens (so the work cannot be skipped).
    """
    # prompts of at most max_model_len - 1 tokens filling the token budget, as the scheduler can
    sched = SchedulerOutput()
    left = num_tokens
    while left > 0:
        n = min(left, max_model_len - 1)
        prompt = _ProfilePrompt([0] * n, [0] * -(-n // block_size))
        sched.scheduled.append(ScheduledRequest(prompt, n))
        left -= n
    inputs = build_step_inputs(sched, block_size, device, attn_backend.index_dtype, write_kv=False)
    model.use_kernels(attn_backend.model_kernels)
    hidden = model(inputs.input_ids, inputs.positions, kv_caches, attn_backend,
                   attn_backend.build_metadata(inputs))
    rows = torch.arange(min(num_sampled, num_tokens), device=device)
    return torch.log_softmax(model.compute_logits(hidden[rows]), dim=-1).argmax(-1)


def profile_kv_cache_bytes(model, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                           block_size: int, gpu_memory_utilization: float, device: torch.device,
                           dtype: torch.dtype, cudagraph_num_tokens: int = 0) -> int:
    """Bytes the KV cache may take on ``device``, with the model's weights already loaded there.

    Args:
        cudagraph_num_tokens: tokens of the largest CUDA graph to be captured (0: none).

    Returns:
        ``gpu_memory_utilization * (free_bytes - activation_peak_bytes - cudagraph_bytes)``, at
        least 0, where ``free_bytes`` is the device's free memory after the weights (other
        processes' use excluded), ``activation_peak_bytes`` the profiled peak of one full step and
        ``cudagraph_bytes`` the activation peak of a forward of ``cudagraph_num_tokens`` tokens.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    # the cache does not exist yet: a one-block scratch cache, never written (every slot is -1)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scratch = torch.zeros(2, cfg.num_key_value_heads, 1, block_size, head_dim, dtype=dtype, device=device)
    backend = select_attention_backend(device, dtype)
    kv_caches = [(scratch[0], scratch[1])] * cfg.num_hidden_layers

    def activation_peak(num_tokens: int, num_sampled: int) -> int:
        torch.cuda.reset_peak_memory_stats(device)
        dummy_step(model, backend, kv_caches, num_tokens, num_sampled, max_model_len, block_size, device)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - weights_bytes

    # the graphs' forward has no logits: one sampled row (dummy_step samples at least one)
    cudagraph_bytes = activation_peak(cudagraph_num_tokens, 1) if cudagraph_num_tokens else 0
    peak_bytes = activation_peak(max_num_batched_tokens, max_num_seqs)
    torch.cuda.empty_cache()
    kv_cache_bytes = max(int(gpu_memory_utilization * (free_bytes - peak_bytes - cudagraph_bytes)), 0)
    logger.info("GPU memory: total %.2f GiB, weights %.2f GiB, free after weights %.2f GiB, "
                "activation peak %.2f GiB (%d tokens), CUDA-graph reserve %.2f GiB (%d tokens), "
                "KV cache %.2f GiB (gpu_memory_utilization=%.2f)",
                total_bytes / GiB, weights_bytes / GiB, free_bytes / GiB, peak_bytes / GiB,
                max_num_batched_tokens, cudagraph_bytes / GiB, cudagraph_num_tokens, kv_cache_bytes / GiB,
                gpu_memory_utilization)
    return kv_cache_bytes
