"""The engine's Triton path end to end on CPU (kernels under the interpreter): greedy tokens equal
transformers' through prefix-cache hits, chunked prefill and padded decode batches."""

import pytest
import torch

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.engine.test_llm_tiny import prompts, shared_prefix_prompts
from tests.kernels.support import import_kernel

import_kernel("paged_attention")

# the engine picks the kernels by itself on CUDA, where bench.greedy_check covers it; here they are
# forced onto the CPU engine and run by the interpreter
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run of the kernel path")

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def expected(tiny_hf_model):
    ps = prompts(lengths=(1, 16, 33)) + shared_prefix_prompts(n=3)
    return ps, [hf_greedy(tiny_hf_model, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]


def kernel_llm(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, dtype="float32", **kw)
    runner = llm.llm_engine.runner
    assert not runner.use_kernels  # CPU: the torch reference path unless told otherwise
    runner.use_kernels = True
    return llm


@pytest.mark.parametrize("budget", [13, 2048])
def test_kernel_path_greedy_equals_transformers(tiny_llama_dir, expected, budget):
    ps, want = expected
    llm = kernel_llm(tiny_llama_dir, max_num_batched_tokens=budget, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    # the shared-prefix prompts ran again: their prefix comes from the cache this time
    again = llm.generate(ps[-3:], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want[-3:]
    assert all(o.num_cached_tokens >= 32 for o in again)


def test_padded_decode_batches_equal_transformers(tiny_llama_dir, expected):
    from weir.engine.cuda_graphs import DecodeGraphs

    ps, want = expected
    llm = kernel_llm(tiny_llama_dir, max_num_seqs=4)
    runner = llm.llm_engine.runner
    # the CUDA-graph buffers and padding, replayed eagerly: 3 running requests use the 4-row batch
    runner.graphs = DecodeGraphs(llm.llm_engine.model, runner.kv_caches, 4, 16, torch.device("cpu"),
                                 capture=False)
    assert runner.graphs.sizes == [1, 2, 4]
    assert [runner.graphs.padded_size(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert [o.outputs[0].token_ids for o in llm.generate(ps[:3], GREEDY)] == want[:3]


@pytest.mark.parametrize("kernels", [False, True])
def test_memory_profiling_step_runs_both_paths(tiny_llama_dir, kernels):
    from weir.engine.gpu_memory import dummy_step

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16, dtype="float32")
    model = llm.llm_engine.model
    before = llm.llm_engine.runner.kv_cache.clone()
    # 70 tokens as prompts of at most 29: three prefills in one step, logits of 4 rows
    toks = dummy_step(model, 70, 4, 30, 16, torch.device("cpu"), torch.float32, kernels)
    assert toks.shape == (4,)
    assert torch.equal(llm.llm_engine.runner.kv_cache, before)
