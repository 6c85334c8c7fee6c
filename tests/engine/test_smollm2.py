"""The engine with the real SmolLM2-135M-Instruct (fp32, CPU) against transformers' own greedy generate
(recorded in ``tests/data/references/smollm2.json``, checked here against the installed transformers)."""

import pytest

from bench.workloads import w_gen_messages as catalog_messages
from weir.engine import LLM, SamplingParams
from weir.model_source import default_model_path
from tests.engine.references import hf_model, hf_tokens, read_reference

pytestmark = pytest.mark.integration

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", max_model_len=1024)


def prompts_of(llm) -> list[list[int]]:
    """The 20 catalog prompts, as weir encodes them (its chat template)."""
    return [llm.encode_prompt(m) for m in catalog_messages(20)]


@pytest.fixture(scope="module")
def expected(llm):
    """(prompts, transformers' greedy tokens), as recorded in ``tests/data/references/smollm2.json``
    (:mod:`tests.engine.references`)."""
    ref = read_reference("smollm2")
    assert ref["max_tokens"] == MAX_TOKENS
    assert prompts_of(llm) == ref["prompts"]  # the same chat template and tokenizer as recorded
    return ref["prompts"], ref["tokens"]


def test_transformers_still_gives_the_recorded_tokens(llm, expected):
    """The record against the installed transformers, on three of its prompts."""
    prompts, want = expected
    picked = [0, 7, 19]
    got = hf_tokens(hf_model(default_model_path()), [prompts[i] for i in picked], MAX_TOKENS,
                    llm.llm_engine.eos_token_ids)
    assert got == [want[i] for i in picked]


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def test_greedy_equals_transformers_together_and_alone(llm, expected):
    prompts, want = expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == want
    assert [llm.generate([p], greedy())[0].outputs[0].token_ids for p in prompts[:4]] == want[:4]


def test_greedy_equals_transformers_without_prefix_caching(llm, expected):
    prompts, want = expected
    eng = llm.llm_engine
    eng.block_pool.enable_caching = False
    try:
        outs = llm.generate(prompts, greedy())
    finally:
        eng.block_pool.enable_caching = True
    assert [o.num_cached_tokens for o in outs] == [0] * 20
    assert [o.outputs[0].token_ids for o in outs] == want


def test_text_and_eos(llm, expected):
    prompts, want = expected
    out = llm.generate([prompts[0]], greedy())[0]
    assert out.outputs[0].text == llm.tokenizer.decode(want[0], skip_special_tokens=True)
    if want[0][-1] in llm.llm_engine.eos_token_ids:
        assert out.outputs[0].finish_reason == "stop"


def test_64_jobs_sharing_a_system_prompt_hit_the_prefix_cache(llm):
    before = llm.stats()
    outs = llm.chat(catalog_messages(64), SamplingParams(temperature=0, max_tokens=4))
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queries == sum(len(o.prompt_token_ids) for o in outs)
    assert hits / queries > 0.5
    assert sum(o.num_cached_tokens for o in outs) == hits
    pool = llm.llm_engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_structured_outputs_are_valid_on_the_real_model(llm):
    """The grid of tests/engine/test_structured_outputs.py on SmolLM2, greedy and sampled: every
    output that finished parses and validates, and most finish."""
    from tests.engine.test_structured_outputs import GRID, constraint, valid

    messages = [[{"role": "user", "content": f"Give a short answer for product {i} in the required format."}]
                for i in range(2 * len(GRID))]
    prompts = [llm.encode_prompt(m) for m in messages]
    specs = [constraint(*GRID[i % len(GRID)]) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0 if i < len(GRID) else 0.8, seed=i, max_tokens=64, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = llm.generate(prompts, params)
    finished = [(s, o.outputs[0]) for s, o in zip(specs, outs) if o.outputs[0].finish_reason == "stop"]
    assert all(valid(s, c.text) for s, c in finished), [(s.kind, c.text) for s, c in finished if not valid(s, c.text)]
    assert len(finished) >= len(prompts) - 2, [o.outputs[0].text for o in outs]
