"""KV-cache size on a GPU: what is left after the weights and a profiled activation peak.

The peak is measured, not estimated: one dummy step of ``max_num_batched_tokens`` prefill tokens
(the largest step the scheduler can build) runs through the model, then logits and a log-softmax
for ``max_num_seqs`` rows, and the allocator's high-water mark above the weights is the activation
peak. The cache gets ``gpu_memory_utilization`` of the free memory minus that peak; the rest is
headroom for the CUDA-graph pool, cuBLAS workspaces and fragmentation (the scheme of vLLM's
``determine_num_available_blocks``).
"""

from __future__ import annotations

import logging

import torch

from weir.engine.attention import AttentionMetadata, PrefillSeq, use_kernels

logger = logging.getLogger(__name__)

GiB = 1 << 30


@torch.inference_mode()
def dummy_step(model, num_tokens: int, num_sampled: int, max_model_len: int, block_size: int,
               device: torch.device, dtype: torch.dtype, kernels: bool) -> torch.Tensor:
    """The largest step the scheduler can build: ``num_tokens`` prompt tokens in prompts of at
    most ``max_model_len - 1`` tokens, then logits and a log-softmax of ``num_sampled`` rows.
    Runs the Triton path when ``kernels``, else the torch reference; nothing is written to the
    engine's KV cache (a one-block scratch cache is used).

    Returns:
        ``[min(num_sampled, num_tokens)]`` int64 argmax tokens (so the work cannot be skipped).
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # prompts of at most max_model_len - 1 tokens filling the token budget, as the scheduler can
    lens = []
    left = num_tokens
    while left > 0:
        lens.append(min(left, max_model_len - 1))
        left -= lens[-1]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    # one cache block serves every layer: no slot is written (kernels) or every write hits it
    cache = torch.zeros(2, cfg.num_key_value_heads, 1, block_size, head_dim, dtype=dtype, device=device)
    kv_caches = [(cache[0], cache[1])] * cfg.num_hidden_layers
    if kernels:
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        width = -(-max(lens) // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, **i32), use_kernels=True,
            prefill_block_tables=torch.zeros(len(lens), width, **i32),
            prefill_query_start_loc=torch.tensor(starts, **i32),
            prefill_context_lens=torch.tensor(lens, **i32), max_prefill_query_len=max(lens),
        )
    else:
        meta = AttentionMetadata(slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device))
        offset = 0
        for n in lens:
            meta.prefills.append(PrefillSeq(offset, n))
            offset += n
    hidden = model(input_ids, positions, kv_caches, meta)
    rows = torch.arange(min(num_sampled, num_tokens), device=device)
    return torch.log_softmax(model.compute_logits(hidden[rows]), dim=-1).argmax(-1)


def profile_kv_cache_bytes(model, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                           block_size: int, gpu_memory_utilization: float, device: torch.device,
                           dtype: torch.dtype) -> int:
    """Bytes the KV cache may take on ``device``, with the model's weights already loaded there.

    Returns:
        ``gpu_memory_utilization * (free_bytes - activation_peak_bytes)``, at least 0, where
        ``free_bytes`` is the device's free memory after the weights (other processes' use
        excluded) and ``activation_peak_bytes`` the profiled peak of one full step.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    dummy_step(model, max_num_batched_tokens, max_num_seqs, max_model_len, block_size, device, dtype,
               use_kernels(device, dtype))
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device) - weights_bytes
    torch.cuda.empty_cache()
    kv_cache_bytes = max(int(gpu_memory_utilization * (free_bytes - peak_bytes)), 0)
    logger.info("GPU memory: total %.2f GiB, weights %.2f GiB, free after weights %.2f GiB, "
                "activation peak %.2f GiB (%d tokens), KV cache %.2f GiB (gpu_memory_utilization=%.2f)",
                total_bytes / GiB, weights_bytes / GiB, free_bytes / GiB, peak_bytes / GiB,
                max_num_batched_tokens, kv_cache_bytes / GiB, gpu_memory_utilization)
    return kv_cache_bytes
