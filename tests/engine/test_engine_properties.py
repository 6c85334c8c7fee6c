"""Property tests: random request mixes, tiny pools, small budgets — greedy outputs never change
and every block comes back."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_hf_model):
    cache = {}

    def greedy(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS, eos_token_id=2)
        return cache[key]

    return greedy


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 40]), min_size=1, max_size=6),
    shared=st.booleans(),
    num_blocks=st.integers(min_value=8, max_value=24),
    budget=st.sampled_from([1, 3, 16, 33, 512]),
    max_num_seqs=st.integers(min_value=1, max_value=6),
    caching=st.booleans(),
    arrivals=st.lists(st.integers(min_value=0, max_value=5), min_size=6, max_size=6),
    max_tokens=st.lists(st.integers(min_value=1, max_value=MAX_TOKENS), min_size=6, max_size=6),
    num_samples=st.lists(st.sampled_from([1, 1, 2]), min_size=6, max_size=6),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_random_mixes_match_transformers_and_free_every_block(
    tiny_llama_dir, reference, lengths, shared, num_blocks, budget, max_num_seqs, caching, arrivals,
    max_tokens, num_samples, seed
):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(20)] if shared else []
    prompts = [(prefix + [rng.randrange(3, 256) for _ in range(n)])[: max(n, 1)] for n in lengths]
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=num_blocks,
              max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
              enable_prefix_caching=caching)
    eng = llm.llm_engine
    # requests arrive mid-run: request i is added after arrivals[i] steps
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids, outs, step = {}, {}, 0
    while pending or eng.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            sp = SamplingParams(temperature=0, max_tokens=max_tokens[i], n=num_samples[i])
            ids[eng.add_request(prompts[i], sp)] = i
        for out in eng.step():
            outs[ids[out.request_id]] = [c.token_ids for c in out.outputs]
        assert all(b.ref_cnt >= 0 for b in eng.block_pool.blocks)
        step += 1
    # greedy samples of one request are identical; a shorter max_tokens is a prefix of the reference
    assert [outs[i] for i in range(len(prompts))] == [
        [reference(p)[:max_tokens[i]]] * num_samples[i] for i, p in enumerate(prompts)]
    assert eng.block_pool.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in eng.block_pool.blocks)
