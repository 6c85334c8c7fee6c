"""Sliding-window attention end to end against transformers, on tiny random-weight models in
fp32 (exact greedy tokens): Mistral with a window of 16 and of 20 (every layer windowed, so blocks
before the window are freed while a request runs) and Qwen2 with one global and one windowed
layer (nothing freed). Prompts of 40-70 tokens outrun the window; batched, alone, through prefix
hits, chunked prefill and preemption by recompute, on the CPU kernel and the torch reference."""

import random

import pytest
import torch

from weir.engine import LLM, SamplingParams
from weir.engine.block_pool import NULL_BLOCK_ID
from weir.engine.models.sliding_window import layer_sliding_windows
from tests.conftest import hf_greedy
from tests.engine import test_model_families as families
from tests.engine.test_llm_tiny import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def save_random(path, config_cls, model_cls, **extra):
    """A tiny random checkpoint (norms and biases random too: a unit norm would hide a missing weight)."""
    return families.save_random(path, config_cls, model_cls, seed=3, **extra)


def window_prompts(seed=0):
    """Six prompts of 40-70 tokens and four sharing a 37-token prefix (prefix hits)."""
    rng = random.Random(seed)
    alone = [[rng.randrange(3, 256) for _ in range(n)] for n in (40, 47, 52, 58, 64, 70)]
    prefix = [rng.randrange(3, 256) for _ in range(37)]
    shared = [prefix + [rng.randrange(3, 256) for _ in range(n)] for n in (5, 12, 21, 30)]
    return alone + shared


@pytest.fixture(scope="module", params=[16, 20])
def mistral(request, tmp_path_factory):
    """(path, prompts, transformers' tokens with the window, transformers' tokens without it)."""
    from transformers import MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp(f"mistral-w{request.param}")
    hf = save_random(path, MistralConfig, MistralForCausalLM, sliding_window=request.param)
    ps = window_prompts()
    want = [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]
    hf.config.sliding_window = None
    hf_global = MistralForCausalLM(hf.config).eval()
    hf_global.load_state_dict(hf.state_dict())
    want_global = [hf_greedy(hf_global, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]
    return str(path), request.param, ps, want, want_global


def make_llm(path, **kw):
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(path, **kw)


def tokens(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]


def test_the_window_changes_transformers_tokens(mistral):
    # what the tests below compare against differs from global attention on these prompts
    _, _, _, want, want_global = mistral
    assert sum(a != b for a, b in zip(want, want_global)) >= 3


@pytest.mark.parametrize("caching", [True, False])
def test_mistral_window_equals_transformers_batched_and_alone(mistral, caching):
    path, window, ps, want, _ = mistral
    llm = make_llm(path, enable_prefix_caching=caching)
    assert llm.llm_engine.model.sliding_windows == [window, window]
    assert llm.llm_engine.kv.sliding_window == window
    assert tokens(llm, ps) == want
    assert [tokens(llm, [p])[0] for p in ps] == want
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_mistral_window_through_chunked_prefill_and_prefix_hits(mistral, budget):
    path, _, ps, want, _ = mistral
    llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=4)
    assert tokens(llm, ps) == want
    hits_before = llm.llm_engine.kv.num_hit_tokens
    assert tokens(llm, ps) == want  # again: every prompt hits the cache
    assert llm.llm_engine.kv.num_hit_tokens - hits_before >= 16 * len(ps)
    assert_all_blocks_free(llm)


def test_mistral_window_on_the_torch_reference_attention(mistral):
    path, _, ps, want, _ = mistral
    llm = make_llm(path, max_num_batched_tokens=20)
    llm.llm_engine.runner.use_cpu_kernel = False
    assert tokens(llm, ps) == want
    assert tokens(llm, ps) == want  # prefix hits
    assert_all_blocks_free(llm)


def test_mistral_window_preempted_and_recomputed_in_a_tiny_pool(mistral):
    path, _, ps, want, _ = mistral
    llm = make_llm(path, num_gpu_blocks_override=8, max_model_len=128)
    assert tokens(llm, ps) == want
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_mistral_window_n_greedy_samples_forked_from_the_prompt(mistral):
    path, _, ps, want, _ = mistral
    llm = make_llm(path)
    outs = llm.generate(ps, SamplingParams(n=2, temperature=0, max_tokens=GREEDY.max_tokens))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
    assert_all_blocks_free(llm)


def test_blocks_before_the_window_are_freed_and_never_read_again(mistral, monkeypatch):
    """Each block freed under the window by its last holder is filled with NaN, its hash forgotten
    and kept out of the pool: a kernel that still read it would turn the logits into NaN."""
    path, window, ps, want, _ = mistral
    llm = make_llm(path, num_gpu_blocks_override=96)
    kv, kv_cache, pool = llm.llm_engine.kv, llm.llm_engine.runner.kv_cache, llm.llm_engine.block_pool
    freed = []

    def poison(blocks):
        for b in blocks:
            if b.ref_cnt > 1:  # another request (a prefix hit) still reads it
                b.ref_cnt -= 1
                continue
            kv_cache[:, :, :, b.block_id] = float("nan")
            pool.uncache_blocks([b])
            freed.append(b.block_id)  # never back in the free queue

    free_skipped = kv._free_skipped_blocks

    def free_skipped_poisoned(req):
        pool.free_blocks = poison
        try:
            free_skipped(req)
        finally:
            del pool.free_blocks

    monkeypatch.setattr(kv, "_free_skipped_blocks", free_skipped_poisoned)
    outs = llm.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    # a 70-token prompt plus 9 generated tokens: its last query (position 78) sees from 78 - W + 1
    assert len(freed) >= (78 - window + 1) // 16
    assert len(set(freed)) == len(freed)


def test_block_table_holds_null_entries_before_the_window(mistral):
    path, window, ps, _, _ = mistral
    engine = make_llm(path, enable_prefix_caching=False).llm_engine
    engine.add_request(ps[5], GREEDY, request_id="r")  # 70 tokens
    (req,) = engine.scheduler.waiting
    tables = []
    while engine.has_unfinished():
        computed = req.num_computed_tokens  # the step's first query position
        engine.step()
        if req.block_table:
            tables.append((computed, list(req.block_table)))
    for computed, table in tables:
        skipped = max(computed - window + 1, 0) // 16
        assert table[:skipped] == [NULL_BLOCK_ID] * skipped and NULL_BLOCK_ID not in table[skipped:]
    # the last decode before the end (position 77) sees 77 - W + 1 on: blocks 0-2 are gone
    assert tables[-1][0] == 77 and tables[-1][1][:3] == [NULL_BLOCK_ID] * 3 and len(tables[-1][1]) == 5
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.fixture(scope="module")
def qwen2_hybrid(tmp_path_factory):
    """Qwen2 with use_sliding_window: layer 0 global (max_window_layers=1), layer 1 a window of 16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2-hybrid")
    hf = save_random(path, Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=16,
                     max_window_layers=1)
    ps = window_prompts(seed=1)
    return str(path), ps, [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]


def test_qwen2_with_a_global_and_a_windowed_layer_equals_transformers(qwen2_hybrid):
    path, ps, want = qwen2_hybrid
    llm = make_llm(path, max_num_batched_tokens=16)
    assert llm.llm_engine.model.sliding_windows == [None, 16]
    assert llm.llm_engine.kv.sliding_window is None  # the global layer reads every block
    assert tokens(llm, ps) == want
    assert tokens(llm, ps) == want  # prefix hits
    assert_all_blocks_free(llm)


def test_windows_read_as_transformers_reads_them():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3)) == [4096] * 3  # the default
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert layer_sliding_windows(Qwen2Config(num_hidden_layers=2, sliding_window=16)) == [None, None]
    assert layer_sliding_windows(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16,
                                             max_window_layers=1)) == [None, 16, 16]
    assert layer_sliding_windows(LlamaConfig(num_hidden_layers=2)) == [None, None]


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 0}, "sliding_window=0 is not a positive number of tokens"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\] are not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None},
     "layer_types has sliding_attention layers but sliding_window is not set"),
])
def test_a_window_the_engine_cannot_honour_is_refused_at_load(change, message):
    from transformers import MistralConfig, Qwen2Config

    cls = MistralConfig if "layer_types" not in change else Qwen2Config
    cfg = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=message):
        LLM(cfg, load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=16)
