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


def test_kv_cache_leaves_room_for_the_cuda_graph_pool(monkeypatch):
    """The cache gets gpu_memory_utilization of what is free after the weights, one full step's
    activation peak and the graph reserve: the peak of a forward of the largest graph's tokens
    (device counters faked: 1 GiB free, 100 bytes of weights, 1,000 bytes of peak per token)."""
    import weir.engine.gpu_memory as gm

    profiled = []
    state = {"allocated": 100, "peak": 100}

    def fake_dummy_step(model, backend, kv_caches, num_tokens, num_sampled, *args):
        profiled.append((num_tokens, num_sampled))
        state["peak"] = state["allocated"] + 1000 * num_tokens

    cuda = torch.cuda
    monkeypatch.setattr(gm, "dummy_step", fake_dummy_step)
    monkeypatch.setattr(gm, "select_attention_backend", lambda device, dtype: None)
    for name, fn in {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
                     "mem_get_info": lambda device=None: (1 << 30, 2 << 30),
                     "memory_allocated": lambda device=None: state["allocated"],
                     "max_memory_allocated": lambda device=None: state["peak"],
                     "reset_peak_memory_stats": lambda device=None: state.update(peak=state["allocated"])}.items():
        monkeypatch.setattr(cuda, name, fn)
    monkeypatch.setattr(torch, "zeros", lambda *shape, **kw: torch.empty(2))

    class Model:
        config = type("Config", (), dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, head_dim=16))

    args = (Model(), 2048, 64, 1024, 16, 0.5, torch.device("cuda"), torch.bfloat16)
    assert gm.profile_kv_cache_bytes(*args) == int(0.5 * ((1 << 30) - 1000 * 2048))
    assert profiled == [(2048, 64)]
    profiled.clear()
    assert gm.profile_kv_cache_bytes(*args, cudagraph_num_tokens=512) == int(0.5 * ((1 << 30) - 1000 * (2048 + 512)))
    assert profiled == [(512, 1), (2048, 64)]


@pytest.mark.parametrize("mode, eager, dtype, want", [
    ("FULL_AND_PIECEWISE", False, "bfloat16", 1024), ("FULL_DECODE_ONLY", False, "bfloat16", 64),
    ("PIECEWISE", False, "float16", 1024), ("NONE", False, "bfloat16", 0),
    ("FULL_AND_PIECEWISE", True, "bfloat16", 0), ("FULL_AND_PIECEWISE", False, "float32", 0)])
def test_graph_reserve_sized_by_the_largest_graph(mode, eager, dtype, want):
    """Tokens of the largest graph the runner captures on CUDA: the piecewise bucket (1024: all
    the batched tokens, under the default cap) or the full decode batch (max_num_seqs 64); none eager or in float32
    (the torch backend: no graphs)."""
    from weir.engine.engine_args import EngineArgs
    from weir.engine.llm_engine import LLMEngine
    from weir.engine.piecewise_graphs import resolve_capture_sizes

    engine = LLMEngine.__new__(LLMEngine)
    engine.args = EngineArgs(cudagraph_mode=mode, enforce_eager=eager, dtype=dtype, max_num_seqs=64)
    engine.dtype = getattr(torch, dtype)
    engine.cudagraph_capture_sizes = resolve_capture_sizes(None, None, 1024)
    assert engine._cudagraph_num_tokens() == want


# allocator rounding (2 MiB pages, 20 MiB segments) and memory outside it (cuBLAS handles, modules)
PROFILE_SLACK_BYTES = 128 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the cache is sized from torch.cuda.mem_get_info")
def test_kv_cache_and_step_peak_fit_the_budget():
    """On the real cache: ``gpu_memory_utilization`` of the memory left after the weights and the
    largest step's activation peak goes to the KV cache, within allocator rounding; the peak is the
    one a real step of ``max_num_batched_tokens`` prompt tokens reaches, not only the profiled one."""
    import gc
    import itertools

    from transformers import LlamaConfig

    from weir.engine import SamplingParams
    from weir.engine.model_runner import ModelRunner

    utilization, max_num_batched_tokens, block_size = 0.5, 8192, 16
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    llm = LLM(cfg, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              gpu_memory_utilization=utilization, max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=64, block_size=block_size, enforce_eager=True)
    engine = llm.llm_engine
    weights_bytes = sum(t.numel() * t.element_size()
                        for t in itertools.chain(engine.model.parameters(), engine.model.buffers()))
    kv_cache = engine.runner.kv_cache
    kv_cache_bytes = kv_cache.numel() * kv_cache.element_size()
    block_bytes = ModelRunner.kv_bytes_per_block(cfg, block_size, torch.bfloat16)
    assert kv_cache.device.type == "cuda"
    assert kv_cache_bytes == engine.num_blocks * block_bytes

    # the largest step the scheduler builds: 8 prompts of 1024 tokens, prefilled together
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident_bytes = torch.cuda.memory_allocated(device)
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(1024)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    torch.cuda.synchronize(device)
    step_peak_bytes = torch.cuda.max_memory_allocated(device) - resident_bytes
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 8

    budget_bytes = utilization * (free_before - weights_bytes - step_peak_bytes)
    assert kv_cache_bytes <= budget_bytes + PROFILE_SLACK_BYTES + block_bytes, (
        kv_cache_bytes, budget_bytes, step_peak_bytes)  # the profile missed part of the real peak
    assert kv_cache_bytes >= budget_bytes - PROFILE_SLACK_BYTES - block_bytes, (
        kv_cache_bytes, budget_bytes, step_peak_bytes)  # the profile over-counted: memory left unused
