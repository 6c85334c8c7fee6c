"""The memory-profiling step runs the engine's own step builder and backend over the engine's real
KV cache and leaves every byte of it as it was (Triton backend: kernels under the interpreter)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # read when a kernel is decorated, before any is imported
    os.environ["TRITON_INTERPRET"] = "1"

from weir.engine import LLM  # noqa: E402
from weir.engine.attention import get_attention_backend  # noqa: E402
from weir.kernels.cpu_paged_attention import is_available as cpu_kernel_available  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_profiling_step_leaves_the_real_cache_untouched(tiny_llama_dir, backend):
    from weir.engine.gpu_memory import dummy_step

    if backend == "cpu" and not cpu_kernel_available():
        pytest.skip("the CPU attention kernel could not be built")
    if backend == "triton":
        pytest.importorskip("triton")
    # the Triton backend on its own device where there is one, else on CPU under the interpreter
    device = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16, dtype=dtype,
              device=device.type, enforce_eager=True)
    runner = llm.llm_engine.runner
    runner.set_attention_backend(get_attention_backend(backend))
    # the cache as a running engine has it: every block holds data (block 0, which the profiling
    # step's block tables point at, included)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    assert runner.kv_cache.device.type == device.type
    before = runner.kv_cache.clone()
    # 70 tokens as prompts of at most 29: three prefills in one step, logits of 4 rows
    toks = dummy_step(llm.llm_engine.model, runner.attn_backend, runner.kv_caches, 70, 4, 30, 16,
                      device)
    assert toks.shape == (4,)
    assert torch.equal(runner.kv_cache, before)
