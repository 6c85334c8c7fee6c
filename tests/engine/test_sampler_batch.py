"""The batched sampler against the row-by-row sampler it replaced (the reference below is that
algorithm, kept here): greedy and seeded tokens are exactly equal on a grid of mixed batches, and a
seeded request's tokens do not depend on its position or its neighbours."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch

from weir.engine.sampler import SampleRow, apply_penalties, filter_logits, sample
from weir.engine.sampling_params import LOGPROB_SENTINEL, SamplingParams

VOCAB = 97


# ---- the row-by-row reference ------------------------------------------------------------------

def ref_penalties(logits, rows):
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            banned = [t for t in banned if t < vocab]
            if banned:
                logits[i, banned] = float("-inf")
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids).union(r.output_token_ids)), dtype=torch.long)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            counts = Counter(r.output_token_ids)
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor(list(counts.values()), dtype=logits.dtype)
            logits[i, ids] -= p.frequency_penalty * n + p.presence_penalty


def ref_filter(row, p):
    row = row / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    if p.min_p > 0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


def ref_top_logprobs(row, token_id, num):
    fin = lambda v: v if math.isfinite(v) else LOGPROB_SENTINEL
    rank = int((row > row[token_id]).sum()) + 1
    out = [(token_id, fin(float(row[token_id])), rank)]
    vals, ids = torch.topk(row, min(num, row.shape[-1]))
    return out + [(int(t), fin(float(v)), r + 1) for r, (v, t) in enumerate(zip(vals, ids))]


def ref_sample(logits, rows):
    """Returns (tokens, logprobs, probs): probs[i] is the filtered distribution of sampled row i."""
    processed = logits.clone()
    ref_penalties(processed, rows)
    out = processed.argmax(dim=-1).tolist()
    probs = {}
    for i, r in enumerate(rows):
        if r.params.is_greedy:
            continue
        probs[i] = ref_filter(processed[i], r.params).softmax(-1)
        out[i] = int(torch.multinomial(probs[i], 1, generator=r.generator).item())
    lps = torch.log_softmax(logits, dim=-1)
    logprobs = [None if r.params.logprobs is None else ref_top_logprobs(lps[i], out[i], r.params.logprobs)
                for i, r in enumerate(rows)]
    return out, logprobs, probs


# ---- the grid ----------------------------------------------------------------------------------

KINDS = {
    "greedy": dict(temperature=0),
    "greedy_penalized": dict(temperature=0, repetition_penalty=1.4, frequency_penalty=0.5, logprobs=3),
    "seeded_plain": dict(temperature=1.0, seed=1),
    "seeded_top_k": dict(temperature=0.7, top_k=5, seed=2, logprobs=2),
    "seeded_top_p": dict(temperature=1.3, top_p=0.8, seed=3),
    "seeded_min_p": dict(temperature=0.9, min_p=0.1, seed=4, logprobs=0),
    "seeded_all": dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=-0.4, seed=5, logprobs=4),
    "seeded_min_tokens": dict(temperature=1.0, min_tokens=6, stop_token_ids=[3, 8], seed=6),
    "unseeded_top_p": dict(temperature=1.0, top_p=0.9, logprobs=5),
    "unseeded_penalized": dict(temperature=0.8, presence_penalty=1.5, min_tokens=9, top_k=3),
}


class Req:
    """A request as the sampler sees it: fixed logits and tokens, a fresh generator per run."""

    def __init__(self, kind: str, salt: int):
        rng = random.Random(f"{kind}-{salt}")
        torch.manual_seed(rng.randrange(2**31))
        self.kind, self.params = kind, SamplingParams(**KINDS[kind])
        self.logits = torch.randn(VOCAB) * 3
        self.logits[rng.randrange(VOCAB)] = float("-inf")
        self.prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        self.output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
        self.output += self.output[:2]  # repeats, for the frequency penalty

    def row(self, default: torch.Generator) -> SampleRow:
        seed = self.params.seed
        gen = torch.Generator().manual_seed(seed) if seed is not None else default
        return SampleRow(self.params, gen, self.prompt, self.output, frozenset({2}))


def run(sampler, reqs):
    default = torch.Generator().manual_seed(1234)
    rows = [q.row(default) for q in reqs]
    return sampler(torch.stack([q.logits for q in reqs]), rows)


def check_batch(reqs):
    want_tokens, want_lp, want_probs = run(ref_sample, reqs)
    got = run(sample, reqs)
    for i, q in enumerate(reqs):
        if q.params.is_greedy or q.params.seed is not None:
            assert got.token_ids[i] == want_tokens[i], (q.kind, i)
        else:  # the default generator's stream is shared: only the support is fixed
            assert want_probs[i][got.token_ids[i]] > 0, (q.kind, i)
        if q.params.logprobs is not None:
            entry = got.logprobs[i]
            assert entry[1:] == want_lp[i][1:] and entry[0] == ref_top_logprobs(
                torch.log_softmax(q.logits, -1), got.token_ids[i], 0)[0], (q.kind, i)
        else:
            assert got.logprobs[i] is None
    return got.token_ids


BATCHES = [list(c) for c in itertools.combinations(sorted(KINDS), 3)][::4] + [sorted(KINDS), ["greedy"] * 4]


@pytest.mark.parametrize("kinds", BATCHES, ids=["+".join(b) for b in BATCHES])
def test_mixed_batches_equal_the_row_by_row_sampler(kinds):
    check_batch([Req(k, salt) for salt, k in enumerate(kinds)])


def test_a_seeded_request_ignores_its_position_and_neighbours():
    me = Req("seeded_all", 99)
    alone = check_batch([me])[0]
    others = [Req(k, s) for s, k in enumerate(sorted(KINDS))]
    for pos in (0, 3, len(others)):
        for neighbours in (others, others[::-1], others[:2]):
            batch = neighbours[:pos] + [me] + neighbours[pos:]
            assert check_batch(batch)[batch.index(me)] == alone


def test_filtered_rows_are_bit_identical_to_filtering_each_row():
    reqs = [Req(k, 7) for k in sorted(KINDS) if not KINDS[k]["temperature"] == 0]
    logits = torch.stack([q.logits for q in reqs])
    batched = filter_logits(logits, [q.params for q in reqs]).softmax(-1)
    for i, q in enumerate(reqs):
        assert torch.equal(batched[i], ref_filter(logits[i], q.params).softmax(-1)), q.kind


def test_seeded_draws_continue_the_generator_stream():
    """Two steps of one seeded row: the second draw equals the reference's second draw."""
    q = Req("seeded_top_p", 3)
    gen_ref, gen_new = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(2):
        want = ref_sample(q.logits[None], [SampleRow(q.params, gen_ref, q.prompt, q.output)])[0]
        got = sample(q.logits[None], [SampleRow(q.params, gen_new, q.prompt, q.output)]).token_ids
        assert got == want


def test_penalized_logits_equal_the_row_by_row_ones():
    reqs = [Req(k, 11) for k in sorted(KINDS)]
    default = torch.Generator()
    rows = [q.row(default) for q in reqs]
    want = torch.stack([q.logits for q in reqs])
    got = want.clone()
    ref_penalties(want, rows)
    apply_penalties(got, rows)
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.stack([q.logits for q in reqs]))  # something was penalized


def test_each_filter_uses_its_own_rows_parameters_among_rows_that_skip_it():
    """Filters run only on the rows asking for them (a sort costs only those rows): rows with
    distinct top-k, top-p and min-p values, interleaved with rows that skip each filter, give
    exactly what filtering each row alone gives."""
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_p=0.95, top_k=7), SamplingParams(temperature=1.3, min_p=0.2),
              SamplingParams(temperature=1.0, top_k=2, min_p=0.05), SamplingParams(temperature=0.9, top_p=0.7)]
    torch.manual_seed(11)
    logits = torch.randn(len(params), VOCAB) * 3
    batched = filter_logits(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(batched[i], ref_filter(logits[i], p)), i
