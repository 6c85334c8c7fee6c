"""The engine's CUDA path end to end on CPU: the Triton backend (kernels under the interpreter),
the same step builder, the fused add+RMSNorm kernel, CUDA-graph bucket padding and graph-input
copies (graphs replayed eagerly). Greedy tokens equal transformers' through prefix-cache hits,
chunked prefill and padded decode batches; only kernel compilation and graph capture are left to
the GPU."""

import pytest
import torch

from weir.engine import LLM, SamplingParams
from weir.engine.attention import TritonAttentionBackend
from tests.conftest import hf_greedy
from tests.engine.test_attention_backends import NAN_BLOCK, WINDOW, run_backend, windowed_step
from tests.engine.test_llm_tiny import prompts, shared_prefix_prompts
from tests.kernels.support import import_kernel

import_kernel("paged_attention")

# the engine picks the Triton backend by itself on CUDA, where bench.greedy_check covers it; here
# it is set on the CPU engine and its kernels run under the interpreter
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run of the kernel path")

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def expected(tiny_hf_model):
    ps = prompts(lengths=(1, 16, 33)) + shared_prefix_prompts(n=3)
    return ps, [hf_greedy(tiny_hf_model, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]


@pytest.fixture
def norm_calls(monkeypatch):
    """Counts calls of the fused add+RMSNorm kernel, with and without a residual."""
    import weir.kernels.rms_norm as mod

    calls = {"plain": 0, "residual": 0}
    kernel = mod.rms_norm

    def counting(x, weight, eps, residual=None):
        calls["residual" if residual is not None else "plain"] += 1
        return kernel(x, weight, eps, residual=residual)

    monkeypatch.setattr(mod, "rms_norm", counting)
    return calls


def kernel_llm(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, dtype="float32", **kw)
    runner = llm.llm_engine.runner
    assert runner.attn_backend.name in ("cpu", "torch")  # CPU: never the Triton backend by itself
    runner.set_attention_backend(TritonAttentionBackend())
    return llm


def test_triton_backend_output_equals_naive_softmax():
    out, want = run_backend(TritonAttentionBackend(), 8)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_triton_backend_with_a_window_equals_naive_softmax_and_never_reads_blocks_before_it():
    out, want = run_backend(TritonAttentionBackend(), 8, sched=windowed_step(8), num_blocks=20, window=WINDOW,
                            nan_block=NAN_BLOCK)
    assert not want.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [13, 2048])
def test_kernel_path_greedy_equals_transformers(tiny_llama_dir, expected, budget, norm_calls):
    ps, want = expected
    llm = kernel_llm(tiny_llama_dir, max_num_batched_tokens=budget, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    # the shared-prefix prompts ran again: their prefix comes from the cache this time
    again = llm.generate(ps[-3:], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want[-3:]
    assert all(o.num_cached_tokens >= 32 for o in again)
    # per step of the 2-layer model: the first layer's input norm alone, then 4 fused add+norms
    # (post-attention, next layer's input, post-attention, final)
    assert norm_calls["residual"] == 4 * norm_calls["plain"] > 0


def test_padded_decode_batches_equal_transformers(tiny_llama_dir, expected, monkeypatch):
    from weir.engine.cuda_graphs import DecodeGraphs

    ps, want = expected
    llm = kernel_llm(tiny_llama_dir, max_num_seqs=4)
    runner = llm.llm_engine.runner
    # the CUDA-graph static inputs and padding, replayed eagerly: 3 running requests use the 4-row batch
    runner.graphs = DecodeGraphs(llm.llm_engine.model, runner.attn_backend, runner.kv_caches, 4, 16, 16,
                                 torch.device("cpu"), capture=False)
    assert runner.graphs.sizes == [1, 2, 4]
    assert [runner.graphs.padded_size(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    replayed = []
    replay = runner.graphs.replay
    monkeypatch.setattr(runner.graphs, "replay", lambda step: replayed.append(step.num_reqs) or replay(step))
    assert [o.outputs[0].token_ids for o in llm.generate(ps[:3], GREEDY)] == want[:3]
    assert 4 in replayed  # the padded batch of 3 decodes ran through the static inputs


def test_piecewise_and_full_graphs_equal_transformers_and_count_each_mode(tiny_llama_dir, tiny_hf_model):
    """FULL_AND_PIECEWISE dispatch through the engine (graphs replayed eagerly): with a budget of
    12 tokens, full graphs up to 2 decodes and piecewise buckets up to 8 tokens, the steps are
    1. prompt 0 (5) + 7 of prompt 1's 9 tokens = 12 tokens: above every bucket, eager;
    2. a decode + prompt 1's last 2 + prompt 2 (3) = 6 tokens: piecewise, bucket 8;
    3. three decodes: more than the full graphs take, piecewise, bucket 4;
    4. two decodes (request 0 is done): full, batch size 2."""
    from weir.engine.cuda_graphs import CUDAGraphMode, build_cuda_graphs

    ps = [[5, 6, 7, 8, 9], list(range(10, 19)), [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=3)
    want = [hf_greedy(tiny_hf_model, p, params.max_tokens, eos_token_id=2) for p in ps]
    llm = kernel_llm(tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=12)
    runner = llm.llm_engine.runner
    runner.graphs, runner.piecewise_graphs, _ = build_cuda_graphs(
        llm.llm_engine.model, runner.attn_backend, runner.kv_caches, CUDAGraphMode.FULL_AND_PIECEWISE, 2, 16, 16,
        [1, 2, 4, 8], torch.device("cpu"), capture=False)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params)] == want
    stats = llm.llm_engine.stats()
    counts = {k: v for k, v in stats.items() if k.startswith("num_") and k.endswith(("_full", "_piecewise", "_eager"))}
    assert counts == {
        "num_steps_cudagraph_full": 1, "num_tokens_cudagraph_full": 2, "num_padding_tokens_cudagraph_full": 0,
        "num_steps_cudagraph_piecewise": 2, "num_tokens_cudagraph_piecewise": 9,
        "num_padding_tokens_cudagraph_piecewise": 3,
        "num_steps_eager": 1, "num_tokens_eager": 12, "num_padding_tokens_eager": 0,
    }
    assert all(stats[f"forward_host_time_s_{m}"] > 0 for m in ("cudagraph_full", "cudagraph_piecewise", "eager"))
    assert not any(k.startswith("forward_gpu_time_s") for k in stats)  # CUDA events only when asked, on CUDA


def test_kernel_path_with_a_window_equals_transformers(tmp_path, monkeypatch):
    """A tiny Mistral with a window of 20 on the Triton backend: chunked prefill over a context,
    decodes through padded static batches (graphs replayed eagerly), prefix hits the second time,
    blocks before the window freed as it slides."""
    from transformers import MistralConfig, MistralForCausalLM

    from weir.engine.cuda_graphs import DecodeGraphs
    from tests.engine.test_sliding_window import save_random, window_prompts

    hf = save_random(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=20)
    ps = [window_prompts()[i] for i in (0, 3, 6, 8)]  # 40 and 58 tokens, two sharing 37
    want = [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]
    llm = kernel_llm(str(tmp_path), max_num_batched_tokens=16, max_num_seqs=4)
    runner = llm.llm_engine.runner
    runner.graphs = DecodeGraphs(llm.llm_engine.model, runner.attn_backend, runner.kv_caches, 4, 16, 16,
                                 torch.device("cpu"), capture=False)
    replayed = []
    replay = runner.graphs.replay
    monkeypatch.setattr(runner.graphs, "replay", lambda step: replayed.append(step.num_reqs) or replay(step))
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    assert 4 in replayed
    again = llm.generate(ps[2:], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want[2:]
    assert all(o.num_cached_tokens >= 32 for o in again)
