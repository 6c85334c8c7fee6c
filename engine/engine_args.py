"""Engine arguments, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional


DTYPE_ALIASES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
"""The ``dtype`` values vLLM accepts (``--dtype``), case-insensitive, and the torch name each means."""
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")


def normalize_dtype(dtype: Any) -> str:
    """The canonical name of a ``dtype`` argument, as vLLM reads it: ``"half"`` -> ``"float16"``,
    ``"float"`` -> ``"float32"``, ``"BFloat16"`` -> ``"bfloat16"``; a ``torch.dtype`` by its name.

    Returns:
        ``"auto"``, ``"float16"``, ``"bfloat16"`` or ``"float32"`` (``getattr(torch, name)`` works).

    Raises:
        ValueError: any other value; the message lists the accepted ones.
    """
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    canonical = DTYPE_ALIASES.get(name.lower())
    if canonical is None:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_ALIASES)}")
    return canonical


class CUDAGraphMode(str, Enum):
    """Which steps replay CUDA graphs (vLLM's ``CompilationConfig.cudagraph_mode`` names).

    - ``NONE``: every step eager;
    - ``PIECEWISE``: every step that fits a bucket replays piecewise graphs;
    - ``FULL_DECODE_ONLY``: decode-only steps replay full graphs, the others run eagerly;
    - ``FULL_AND_PIECEWISE``: decode-only steps replay full graphs (attention inside: faster),
      every other step that fits a bucket piecewise graphs.
    """

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @property
    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass
class EngineArgs:
    """Everything that shapes one engine instance.

    Attributes:
        model: GGUF file, local Hugging Face folder, None (packaged SmolLM2), or with
            ``load_format="dummy"`` also a transformers config object.
        tokenizer: tokenizer location when it differs from ``model``.
        load_format: ``"auto"`` (real weights) or ``"dummy"`` (random weights).
        dtype: ``"auto"`` = bf16 on CUDA, fp32 on CPU; vLLM's names are accepted and normalised
            (``"half"``/``"float16"``, ``"bfloat16"``, ``"float"``/``"float32"``, a ``torch.dtype``;
            :func:`normalize_dtype`), so it always holds a canonical name after construction.
        device: ``"auto"`` = CUDA when available.
        max_model_len: longest prompt + output in tokens; default the model's
            ``max_position_embeddings``.
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step.
        block_size: tokens per KV block.
        gpu_memory_utilization: on CUDA, the fraction of the memory left free after loading the
            weights, profiling one full step's activations and reserving the CUDA-graph pool that
            the KV cache takes (``weir.engine.gpu_memory``); the rest is headroom (workspaces).
        cpu_kv_cache_bytes: KV-cache size on CPU, bytes.
        num_gpu_blocks_override: fix the number of KV blocks (any device).
        enable_prefix_caching: reuse cached full blocks of equal prefixes.
        seed: seed of the default sampling generator.
        skip_tokenizer_init: load no tokenizer (prompts must be token ids).
        enforce_eager: on CUDA, run every step eagerly (no CUDA graphs, whatever ``cudagraph_mode``).
        cudagraph_mode: which steps replay CUDA graphs on CUDA (vLLM's names,
            ``CUDAGraphMode``): ``FULL_AND_PIECEWISE`` (decode-only steps a
            full graph, every other step that fits a bucket piecewise graphs), ``PIECEWISE``,
            ``FULL_DECODE_ONLY`` or ``NONE``; case-insensitive, held upper-case.
        cudagraph_capture_sizes: the piecewise buckets (token counts, integers >= 1; held sorted
            and distinct, as vLLM holds them); default
            ``weir.engine.piecewise_graphs.piecewise_capture_sizes``.
        max_cudagraph_capture_size: the largest piecewise bucket (default 2048, at most
            ``max_num_batched_tokens``); steps with more tokens run eagerly.
        measure_step_gpu_time: also time each step's forward with CUDA events, per graph mode
            (``LLMEngine.stats()`` ``forward_gpu_time_s_*``).
        max_logprobs: most log-probabilities a request may ask for per position (``logprobs``,
            ``prompt_logprobs``); vLLM's default, 20.
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"priority"`` (each request's
            ``priority``, lower first, then arrival; lower-priority running requests are preempted
            first and to make room), vLLM's names (``weir.engine.scheduler``).
        strict_priority: with ``scheduling_policy="priority"``, step only the requests of the best
            priority value present; worse ones keep their blocks and wait, unstepped
            (``weir.engine.scheduler``). Off: every running request shares each step, as in vLLM.
    """

    model: Any = None
    tokenizer: Optional[str] = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    max_logprobs: int = 20
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None
    measure_step_gpu_time: bool = False
    scheduling_policy: str = "fcfs"
    strict_priority: bool = False

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        modes = [m.value for m in CUDAGraphMode]
        if str(self.cudagraph_mode).upper() not in modes:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r} is not one of {', '.join(modes)}")
        self.cudagraph_mode = str(self.cudagraph_mode).upper()
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            # vLLM keeps the buckets sorted and distinct whatever order they were given in
            if isinstance(sizes, (str, bytes)) or not all(is_int(b) and b >= 1 for b in sizes) or not sizes:
                raise ValueError(f"cudagraph_capture_sizes={sizes!r} must be a non-empty list of integers >= 1")
            self.cudagraph_capture_sizes = sorted(set(sizes))
        if self.max_cudagraph_capture_size is not None and not is_int(self.max_cudagraph_capture_size):
            raise ValueError(f"max_cudagraph_capture_size={self.max_cudagraph_capture_size!r} must be an integer")
        if not isinstance(self.strict_priority, bool):
            raise ValueError(f"strict_priority={self.strict_priority!r} must be True or False")
        if self.strict_priority and self.scheduling_policy != "priority":
            raise ValueError("strict_priority=True needs scheduling_policy='priority'")
        if not isinstance(self.measure_step_gpu_time, bool):
            raise ValueError(f"measure_step_gpu_time={self.measure_step_gpu_time!r} must be True or False")
        checks = {
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "block_size": self.block_size >= 1,
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "cpu_kv_cache_bytes": self.cpu_kv_cache_bytes >= 1,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 1,
            "num_gpu_blocks_override": self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            "load_format": self.load_format in LOAD_FORMATS,
            "device": self.device in DEVICES,
            "max_logprobs": self.max_logprobs >= 0,
            "max_cudagraph_capture_size": self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 1,
            "scheduling_policy": self.scheduling_policy in ("fcfs", "priority"),
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range")


def is_int(v: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(v, int) and not isinstance(v, bool)
