"""The transformers baselines every benchmark measures weir against, in one place.

- :func:`hf_static_generate`: ``model.generate`` on left-padded batches in request order, each
  batch run to its longest requested output (what a plain HF batch job does).
- :func:`hf_continuous_batching`: transformers' own continuous batching (the manager behind
  ``generate_batch``, sized by the same workload hints), each request with its own
  ``max_new_tokens``.

Both take requests as ``(prompt token ids, max new tokens)`` and an EOS set (empty: run every
request to its length, ``ignore_eos``), and return the seconds they took, device work included,
and each request's generated tokens (for static batches: up to the batch's longest output, so a
caller counts its useful tokens, :func:`useful_tokens`).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

Request = tuple[list[int], int]
"""``(prompt token ids, max new tokens)``."""


def load_hf_model(model: Optional[str], dtype: torch.dtype, device: str):
    """transformers' ``AutoModelForCausalLM`` of a weir model reference (None: the packaged
    SmolLM2 GGUF, de-quantized), in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    from weir.model_source import resolve_model

    src = resolve_model(model)
    return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.hf_kwargs()).to(device).eval()


def hf_model_from_config(config, dtype: torch.dtype, device: str):
    """A random-weight ``AutoModelForCausalLM`` of a transformers config, built on ``device``."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else 0 (padded positions are masked or never read)."""
    return tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0


def useful_tokens(ids: list[int], eos: Iterable[int]) -> int:
    """Tokens up to and including the first EOS (all of them without one)."""
    eos = set(eos)
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


def release_engine(llm) -> None:
    """Drop weir's KV cache pool and CUDA graphs (and, on CUDA, return their memory to the device)
    before a peer runs in the same process, so the peer gets the card weir had.

    ``llm`` stays usable for its tokenizer and config, not for generation.

    Raises:
        RuntimeError: something still holds the KV cache tensor after the release.
    """
    import gc
    import weakref

    runner = llm.llm_engine.runner
    if runner.kv_cache is None:
        return
    pool = weakref.ref(runner.kv_cache)
    runner.kv_cache = runner.kv_caches = runner.graphs = runner.piecewise_graphs = None
    device = runner.device
    del runner
    gc.collect()
    if pool() is not None:
        raise RuntimeError("weir's KV cache pool is still referenced after release_engine")
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def check_generated(system: str, requested: list[int], generated: list[int], exact: bool = True) -> list[str]:
    """Why a system's counted tokens were not all generated, one line per request (at most 5 and a
    count); empty when each request generated its ``requested`` tokens (``exact``) or at least
    that many (not ``exact``: a static batch runs to its longest member)."""
    if len(requested) != len(generated):
        return [f"{system}: {len(generated)} outputs for {len(requested)} requests"]
    bad = [(i, r, g) for i, (r, g) in enumerate(zip(requested, generated)) if (g != r if exact else g < r)]
    lines = [f"{system}: request {i} generated {g} tokens of {r} requested" for i, r, g in bad[:5]]
    if len(bad) > 5:
        lines.append(f"{system}: {len(bad) - 5} more requests short")
    return lines


def check_stopped(system: str, outputs: Iterable[list[int]], eos: Iterable[int], max_tokens: int) -> list[str]:
    """Why outputs that stop at EOS were not generated in full, one line per request (at most 5 and
    a count); empty when every output is non-empty and ends at its first EOS or at ``max_tokens``
    tokens without one."""
    eos = set(eos)
    bad = []
    for i, ids in enumerate(outputs):
        ids = list(ids)
        n = useful_tokens(ids, eos)
        if not ids or n != len(ids) or (ids[-1] not in eos and len(ids) != max_tokens):
            bad.append(f"{system}: request {i} returned {len(ids)} tokens, {n} up to its first EOS, "
                       f"ending {'at' if ids and ids[-1] in eos else 'without'} EOS (max_tokens {max_tokens})")
    return bad[:5] + ([f"{system}: {len(bad) - 5} more requests"] if len(bad) > 5 else [])


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_static_generate(hf, requests: list[Request], batch_size: int, eos: Iterable[int],
                       pad_id: int = 0) -> tuple[float, list[list[int]]]:
    """Greedy ``hf.generate`` over left-padded batches of ``batch_size`` requests in order.

    Returns:
        (seconds, generated tokens of each request): every row of a batch runs to the batch's
        longest ``max new tokens`` or until all rows met EOS; rows past their EOS hold ``pad_id``.
    """
    from transformers import GenerationConfig

    eos_ids = sorted(eos) or None  # None: the batch runs to its longest requested output
    synchronize(hf.device)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=hf.device)
        config = GenerationConfig(max_new_tokens=max(o for _, o in batch), do_sample=False,
                                  eos_token_id=eos_ids, pad_token_id=pad_id)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=config)
        outputs.extend(out[:, width:].tolist())
    synchronize(hf.device)
    return time.perf_counter() - start, outputs


def hf_continuous_batching(hf, requests: list[Request], eos: Iterable[int], pad_id: int = 0,
                           timeout_s: float = 30.0, continuous_batching_config=None) -> tuple[float, list[list[int]]]:
    """Greedy transformers continuous batching, as ``generate_batch`` runs it (its workload
    hints, warm-up included in the time), with each request's own ``max new tokens``.

    Args:
        continuous_batching_config: transformers' ``ContinuousBatchingConfig``; None, what the
            benchmarks use, is transformers' default (its cache sized from the free memory).

    Returns:
        (seconds, generated tokens of each request, in request order).

    Raises:
        RuntimeError: the manager's thread stopped before every request finished.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    eos_ids = sorted(eos)
    longest = max(o for _, o in requests)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=eos_ids or None,
                              pad_token_id=pad_id)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests), max_generated_length=longest,
                          num_requests=len(requests))
    results = {}
    synchronize(hf.device)
    start = time.perf_counter()
    with torch.inference_mode(), hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=timeout_s, workload_hints=hints,
            continuous_batching_config=continuous_batching_config) as manager:
        for i, (prompt, max_new_tokens) in enumerate(requests):
            # -1: no EOS at all (the model config's EOS would otherwise stop an ignore_eos request)
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=max_new_tokens,
                                eos_token_id=eos_ids or -1)
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"continuous batching stopped after {len(results)} of {len(requests)} requests")
    synchronize(hf.device)
    return time.perf_counter() - start, [list(results[f"r{i}"].generated_tokens) for i in range(len(requests))]
