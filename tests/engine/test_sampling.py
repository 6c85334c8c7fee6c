"""SamplingParams, the sampler, n > 1, logprobs, penalties, min_tokens and deadlines (exact values)."""

import math

import pytest
import torch

from weir.engine import SamplingParams
from weir.engine.sampler import SampleRow, apply_penalties, filter_logits, sample
from weir.engine.sampling_params import LOGPROB_SENTINEL
from tests.conftest import hf_greedy
from tests.engine.test_llm_tiny import assert_all_blocks_free, make_llm, prompts


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_k": -2}, "top_k must be -1, 0 (disabled) or >= 1, got -2"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"seed": -1}, "seed must be None or in [0, 2**63), got -1"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"min_tokens": 17}, "min_tokens must be an integer in [0, max_tokens=16], got 17"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0, got 0"),
    ({"logprobs": -1}, "logprobs must be None or >= 0, got -1"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs must be None or >= 0, got 1.5"),
    ({"stop": ["ok", ""]}, "stop must be non-empty strings, got ['ok', '']"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids must be non-negative integers, got [3, -1]"),
    ({"stop": 5}, "stop must be None, a string or a list of strings, got 5"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids, got 7"),
])
def test_out_of_range_fields_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_defaults_are_vllms():
    sp = SamplingParams(stop="END", top_k=-1)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.min_tokens) == (
        1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.stop == ["END"] and sp.logprobs is None and sp.skip_special_tokens


def row(params, prompt=(), output=(), eos=frozenset()):
    return SampleRow(params, None, list(prompt), list(output), frozenset(eos))


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [row(sp, prompt=[0], output=[1, 3, 3])])
    # token 0 (prompt): 2/2; token 1 (output once): -2*2 - 0.5 - 0.25; token 3 (twice): 0.5/2 - 1 - 0.25
    assert logits.tolist() == [[1.0, -4.75, 1.0, -1.0, 3.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    sp = SamplingParams(min_tokens=2, stop_token_ids=[3])
    logits = torch.zeros(1, 5)
    apply_penalties(logits, [row(sp, output=[1], eos={4})])
    assert logits.tolist() == [[0, 0, 0, -math.inf, -math.inf]]
    logits = torch.zeros(1, 5)
    apply_penalties(logits, [row(sp, output=[1, 1], eos={4})])
    assert logits.tolist() == [[0, 0, 0, 0, 0]]


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits[None], [SamplingParams(**kw)])[0]).tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]  # 0.5 < 0.7, then 0.75 reaches it
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(min_p=0.35) == [True, True, False, False]  # 0.15 < 0.35 * 0.5
    assert kept(min_p=0.25) == [True, True, True, False]  # 0.1 < 0.125 <= 0.15


def test_logprobs_entries_have_ranks_and_no_infinities():
    logits = torch.tensor([[0.0, float("-inf"), 2.0, 1.0]])
    out = sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])
    lp = torch.log_softmax(torch.tensor([0.0, -30.0, 2.0, 1.0]), -1)  # finite part is the same
    (sampled, first, second) = out.logprobs[0]
    assert out.token_ids == [2] and sampled[0] == 2 and sampled[2] == 1 and first[:1] == (2,)
    assert sampled[1] == pytest.approx(lp[2].item(), abs=1e-6)
    assert second[0] == 3 and second[2] == 2
    chosen = sample(logits, [row(SamplingParams(temperature=0, logprobs=0))]).logprobs[0]
    assert len(chosen) == 1
    entry = sample(torch.tensor([[0.0, float("-inf")]]), [row(SamplingParams(temperature=1.0, logprobs=2,
                                                                              seed=0))])
    assert entry.logprobs[0][-1] == (1, LOGPROB_SENTINEL, 2)


def test_seeded_tokens_are_the_row_by_row_samplers(tiny_llama_dir):
    """Seeded requests with filters and penalties next to a greedy one, through the engine."""
    llm = make_llm(tiny_llama_dir)
    ps = prompts(seed=5, lengths=(4, 19, 33))
    sps = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3,
                       presence_penalty=0.2, seed=12, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    ]
    outs = llm.generate(ps, sps)
    # recorded once with the row-by-row sampler this one replaced (revision 95ed8dc)
    assert [o.outputs[0].token_ids for o in outs] == [
        [14, 123, 30, 198, 168, 116, 55, 86, 204, 82],
        [103, 177, 228, 248, 36, 60, 37, 142, 230, 103],
        [60, 186, 211, 181, 51, 144, 215, 6, 47, 233],
    ]
    first = outs[1].outputs[0].logprobs[0]
    assert [(t, e.rank) for t, e in first.items()] == [(103, 3), (99, 1), (219, 2)]
    assert first[103].logprob == pytest.approx(-3.3661680221557617, abs=1e-6)


def test_greedy_top_k_1_and_tiny_top_p_agree(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    ps = prompts(lengths=(3, 17, 33))
    runs = [llm.generate(ps, sp) for sp in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=12, ignore_eos=True, seed=4),
    )]
    ids = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert ids[0] == ids[1] == ids[2]


def test_repetition_penalty_matches_transformers(tiny_llama_dir, tiny_hf_model):
    llm = make_llm(tiny_llama_dir)
    ps = prompts(lengths=(5, 20))
    sp = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    want = []
    for p in ps:
        out = tiny_hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                                     eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert got == want


def test_min_tokens_defers_a_stop_token(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    p = [[9, 8, 7]]
    first = llm.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids[0]
    stopped = llm.generate(p, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    later = llm.generate(p, SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                           stop_token_ids=[first]))[0].outputs[0]
    assert first not in later.token_ids[:3] and len(later.token_ids) >= 3
    assert later.finish_reason == ("stop" if first in later.token_ids else "length")


def test_logprobs_and_prompt_logprobs_equal_a_forward_pass(tiny_llama_dir, tiny_hf_model):
    llm = make_llm(tiny_llama_dir)
    prompt = prompts(lengths=(20,))[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # warm the prefix cache
    (out,) = llm.generate([prompt], sp)
    comp = out.outputs[0]
    full = prompt + comp.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(tiny_hf_model(torch.tensor([full])).logits[0].float(), -1)
    assert out.num_cached_tokens == 0  # prompt_logprobs computes the whole prompt
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(lp[pos - 1, prompt[pos]].item(), abs=1e-4)
        top = torch.topk(lp[pos - 1], 2).indices.tolist()
        assert set(top) <= set(entry) and entry[top[0]].rank == 1
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        want = lp[len(prompt) - 1 + i, tok].item()
        assert entry[tok].logprob == pytest.approx(want, abs=1e-4) and entry[tok].rank == 1
        assert len(entry) == 3  # greedy token is one of the top 3
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total)


def test_n_samples_share_prompt_blocks_differ_and_repeat(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = prompts(lengths=(40,))[0]
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    rid = eng.add_request(prompt, sp)
    eng.step()  # prefill of the prompt: sample 0 draws its first token, the others fork
    (parent,) = [r for r in eng.scheduler.running if r.request_id == rid]
    children = [r for r in eng.scheduler.waiting if r.request_id.startswith(rid + "/")]
    assert [c.request_id for c in children] == [f"{rid}/{i}" for i in (1, 2, 3)]
    for c in children:  # 40 prompt tokens: blocks 0-1 shared, the last prompt token recomputed
        assert c.num_computed_tokens == 39 and c.block_table[:2] == parent.block_table[:2]
        assert c.block_table[2] != parent.block_table[2]
    assert [eng.block_pool.blocks[b].ref_cnt for b in parent.block_table[:2]] == [4, 4]
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (out,) = outs
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len(set(map(tuple, samples))) == 4
    again = llm.generate([prompt], sp)[0]
    assert [c.token_ids for c in again.outputs] == samples
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == samples[0]
    assert_all_blocks_free(llm)


def test_greedy_n_samples_are_identical_and_equal_transformers(tiny_llama_dir, tiny_hf_model):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16)
    prompt = prompts(lengths=(33,))[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    want = hf_greedy(tiny_hf_model, prompt, 8)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    one = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=1))[0]
    assert [c.token_ids for c in one.outputs] == [want[:1]] * 2
    assert_all_blocks_free(llm)


def test_deadline_aborts_and_frees_blocks(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.add_request([5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=200, ignore_eos=True),
                    request_id="slow", timeout_s=0.05)
    fast = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    slow = outs["slow"]
    assert [c.finish_reason for c in slow.outputs] == ["abort", "abort"]
    assert [c.stop_reason for c in slow.outputs] == ["timeout", "timeout"]
    assert all(len(c.token_ids) < 200 for c in slow.outputs)
    assert outs[fast].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        eng.add_request([1], SamplingParams(), timeout_s=0)
    assert_all_blocks_free(llm)


def test_stats_report_per_request_timings(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    outs = llm.generate(prompts(lengths=(4, 9)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    m = outs[0].metrics
    assert m["queue_time_s"] >= 0 and m["time_to_first_token_s"] >= m["queue_time_s"]
    assert m["e2e_latency_s"] >= m["time_to_first_token_s"]
    stats = llm.stats()
    assert stats["e2e_latency_s"]["count"] == 2 and stats["time_to_first_token_s"]["count"] == 2
    assert stats["num_generation_tokens"] == 6 and stats["num_prompt_tokens"] == 13


def test_flags_must_be_booleans_and_logprobs_are_capped(tiny_llama_dir):
    with pytest.raises(ValueError) as err:
        SamplingParams(ignore_eos="no")
    assert str(err.value) == "ignore_eos must be True or False, got 'no'"
    eng = make_llm(tiny_llama_dir).llm_engine
    with pytest.raises(ValueError) as err:
        eng.add_request([1, 2], SamplingParams(logprobs=21))
    assert str(err.value) == "logprobs=21 is more than max_logprobs=20"
    with pytest.raises(ValueError) as err:
        eng.add_request([1, 2], SamplingParams(prompt_logprobs=10**9))
    assert str(err.value) == "prompt_logprobs=1000000000 is more than max_logprobs=20"
    assert not eng.has_unfinished()
