"""The engine against transformers on a tiny random-weight Llama (exact token equality)."""

import random

import pytest
import torch

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def prompts(seed=0, lengths=(1, 5, 15, 16, 17, 31, 32, 33, 47, 60)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(n=6, prefix_len=37, seed=1):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def make_llm(path, **kw):
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(path, **kw)


def assert_all_blocks_free(llm):
    pool = llm.llm_engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert llm.llm_engine.kv.req_blocks == {}


@pytest.fixture(scope="module")
def expected(tiny_hf_model):
    ps = prompts() + shared_prefix_prompts()
    return ps, [hf_greedy(tiny_hf_model, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_transformers_batched_and_alone(tiny_llama_dir, expected, caching):
    ps, want = expected
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=caching)
    together = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    assert together == want
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in ps]
    assert alone == want
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [1, 7, 16, 64])
def test_chunked_prefill_under_small_token_budget(tiny_llama_dir, expected, budget):
    ps, want = expected
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [7, 512])
def test_torch_reference_attention_matches_too(tiny_llama_dir, expected, budget):
    """The torch attention path (used where the CPU kernel cannot be built) gives the same tokens."""
    ps, want = expected
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget)
    llm.llm_engine.runner.use_cpu_kernel = False
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want  # prefix hits
    assert_all_blocks_free(llm)


def test_tiny_pool_preempts_and_output_is_unchanged(tiny_llama_dir, expected):
    ps, want = expected
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=8, max_model_len=128)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == want
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_and_cached_token_counts(tiny_llama_dir):
    ps = shared_prefix_prompts()
    llm = make_llm(tiny_llama_dir)
    outs = llm.generate(ps, GREEDY)
    # the 37-token prefix has 2 full blocks; the first request computes them, the rest hit them
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32, 32, 32]
    s = llm.stats()
    assert s["prefix_cache_hits"] == 5 * 32
    assert s["prefix_cache_queries"] == sum(len(p) for p in ps)


@pytest.mark.parametrize("n", [16, 32, 48])
def test_block_aligned_prompt_cold_then_warm(tiny_llama_dir, tiny_hf_model, n):
    p = prompts(seed=n, lengths=(n,))[0]
    want = hf_greedy(tiny_hf_model, p, 12, eos_token_id=2)
    llm = make_llm(tiny_llama_dir)
    cold = llm.generate([p], GREEDY)[0]
    warm = llm.generate([p], GREEDY)[0]
    assert cold.outputs[0].token_ids == want and warm.outputs[0].token_ids == want
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == n - 16  # last block recomputed: its last token needs logits


def test_max_tokens_and_finish_reasons(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    first = out.outputs[0].token_ids[0]
    stop = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[first]))[0]
    assert stop.outputs[0].token_ids == [first] and stop.outputs[0].finish_reason == "stop"
    assert stop.outputs[0].stop_reason == first


def test_seeded_sampling_independent_of_batch_mates(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], sp)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True)
    mixed = llm.generate([[1, 2, 3, 4], [9, 8, 7], [5] * 20], [other, sp, other])
    assert mixed[1].outputs[0].token_ids == alone
    greedy = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    top1 = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.7, top_k=1, max_tokens=10,
                                                     ignore_eos=True, seed=5))[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_bad_prompts_raise_clear_errors(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="64 tokens, more than max_model_len=64"):
        llm.generate([[5] * 64], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 300]], GREEDY)
    with pytest.raises(ValueError, match="labels is empty"):
        llm.classify([[5, 6]], [])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert_all_blocks_free(llm)


def test_pool_smaller_than_max_model_len_fails_at_start(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs 16 KV blocks of 16 tokens but only 4 fit"):
        make_llm(tiny_llama_dir, num_gpu_blocks_override=4)


def test_classify_equals_forward_scoring(tiny_llama_dir, tiny_hf_model):
    """Label scores equal a plain forward pass over prompt + label (sum of label-token logprobs)."""
    llm = make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = prompts(lengths=(21,))[0]
    labels = ["a", "b", "c", "d"]
    label_ids = [[10], [11, 12], [11, 13, 14], [20, 21, 22, 23, 24, 25]]
    rid = eng.add_classification(prompt, labels, label_ids)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (out,) = outs
    assert out.request_id == rid
    for lab, ids in zip(labels, label_ids):
        x = torch.tensor([prompt + ids])
        with torch.no_grad():
            lp = torch.log_softmax(tiny_hf_model(x).logits[0].float(), -1)
        want = sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids))
        assert out.logprobs[lab] == pytest.approx(want, abs=1e-4)
    assert abs(sum(out.probs.values()) - 1) < 1e-9
    assert out.label == max(out.logprobs, key=out.logprobs.get)
    # label tokens computed: "b" and "c" share token 11 (computed once), then "c" adds 13 (its
    # last token 14 needs no logits); "d" computes 20..24 — 1 + 1 + 5 instead of 0 + 1 + 2 + 5
    assert out.num_label_tokens == 1 + 1 + 5
    assert_all_blocks_free(llm)


def forward_label_scores(hf_model, prompt, label_ids):
    scores = []
    for ids in label_ids:
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        scores.append(sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)))
    return scores


def test_hierarchical_labels_share_prefixes_and_length_normalize(tiny_llama_dir, tiny_hf_model):
    """category > sub-category labels: each shared prefix is computed once; scores equal a plain
    forward pass; length normalization divides each label's sum by its token count."""
    llm = make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = prompts(lengths=(18,))[0]
    sep = [40, 41]  # " > "
    fruits, dairy = [30, 31, 32], [50]
    label_ids = [fruits + sep + [60], fruits + sep + [61, 62], fruits + sep + [63, 64, 65], dairy + sep + [70],
                 dairy + [2]]
    labels = ["Fruits > Fresh", "Fruits > Exotic", "Fruits > Cut", "Dairy > Milk", "Dairy"]
    want = forward_label_scores(tiny_hf_model, prompt, label_ids)
    for normalize in (False, True):
        rid = eng.add_classification(prompt, labels, label_ids, length_normalize=normalize)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        (out,) = outs
        assert out.request_id == rid
        for lab, ids, w in zip(labels, label_ids, want):
            assert out.logprobs[lab] == pytest.approx(w / len(ids) if normalize else w, abs=1e-4)
        assert abs(sum(out.probs.values()) - 1) < 1e-9
        # trie: root -> "30 31 32 40 41" (5) -> {60 leaf: 0, "61 62": 1, "63 64 65": 2};
        #       root -> "50" (1) -> {"40 41 70": 2, "2": 0}
        assert out.num_label_tokens == 5 + 0 + 1 + 2 + 1 + 2 + 0
    assert_all_blocks_free(llm)


def test_classification_errors(tiny_llama_dir):
    eng = make_llm(tiny_llama_dir).llm_engine
    with pytest.raises(ValueError, match="labels must be distinct"):
        eng.add_classification([1, 2], ["a", "a"], [[3], [4]])
    with pytest.raises(ValueError, match="two labels have the same tokens"):
        eng.add_classification([1, 2], ["a", "b"], [[3, 4], [3, 4]])
    with pytest.raises(ValueError, match="every label needs at least one token"):
        eng.add_classification([1, 2], ["a", "b"], [[3], []])
    assert not eng.has_unfinished()


def test_priority_scheduling_orders_requests_and_keeps_their_tokens(tiny_llama_dir, expected):
    """scheduling_policy="priority": lower values start first (one sequence at a time here), a
    tiny pool preempts the lower priorities, and every output equals transformers' greedy one."""
    ps, want = expected
    llm = make_llm(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1)
    priority = [len(ps) - i for i in range(len(ps))]  # the last prompt first
    outs = llm.generate(ps, GREEDY, priority=priority)
    assert [o.outputs[0].token_ids for o in outs] == want
    started = sorted(range(len(ps)), key=lambda i: outs[i].metrics["first_scheduled_time"])
    assert started == list(reversed(range(len(ps))))
    small = make_llm(tiny_llama_dir, scheduling_policy="priority", num_gpu_blocks_override=8, max_model_len=128)
    assert [o.outputs[0].token_ids for o in small.generate(ps, GREEDY, priority=priority)] == want
    assert small.stats()["num_preemptions"] > 0
    assert_all_blocks_free(small)
    # strict: each priority value runs alone, the best first, with the same tokens
    strict = make_llm(tiny_llama_dir, scheduling_policy="priority", strict_priority=True)
    outs = strict.generate(ps, GREEDY, priority=priority)
    assert [o.outputs[0].token_ids for o in outs] == want
    ended = sorted(range(len(ps)), key=lambda i: outs[i].metrics["finished_time"])
    assert ended == list(reversed(range(len(ps))))
    assert_all_blocks_free(strict)
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        make_llm(tiny_llama_dir).generate(ps[:1], GREEDY, priority=[1])


def test_ignore_eos_generates_past_the_eos_token_and_without_it_the_request_stops_there(tiny_llama_dir, tmp_path):
    """The model's greedy third token made its EOS: ``ignore_eos`` keeps the whole greedy sequence
    (the benchmarks count those tokens as generated); without it the request stops on that token."""
    import json
    import shutil

    prompt = [[5, 6, 7, 8]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = make_llm(tiny_llama_dir).generate(prompt, sp)[0].outputs[0].token_ids
    eos = want[2]
    assert eos not in want[:2]
    path = tmp_path / "eos-model"
    shutil.copytree(tiny_llama_dir, path)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            cfg = json.loads((path / name).read_text())
            cfg["eos_token_id"] = eos
            (path / name).write_text(json.dumps(cfg))
    llm = make_llm(str(path))
    past = llm.generate(prompt, sp)[0].outputs[0]
    assert (past.token_ids, past.finish_reason) == (want, "length")
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason) == (want[:3], "stop")
