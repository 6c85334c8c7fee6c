"""Greedy equality: weir's engine against transformers on real weights, same device and dtype.

Usage::

    python -m bench.greedy_check [--n 8] [--device cuda] [--dtype bfloat16] [--min-divergence 64]
                                 [--max-tie-gap 1.0] [--budgets 8192,48] [--model PATH] [--json out.jsonl]

Each of the first ``n`` W-gen catalog prompts is decoded greedily (``max_tokens`` 64, stop at EOS)
by weir (all prompts batched together) and by transformers ``generate`` (one prompt at a time,
unpadded). weir runs once per token budget of ``--budgets`` (``max_num_batched_tokens``, its engine
released before the next one and before transformers runs); a budget below the longest prompt
splits the prompts into chunks that run in the same steps as the decodes of the prompts already
done (chunked prefill beside decodes, through the piecewise graphs on CUDA), and the check refuses a
budget that would not. One JSON line per prompt and budget gives the first position where the token ids differ (null when
they are equal) and, there, transformers' own logit gap between its token and weir's (its logits
for the prompt plus the tokens both agreed on); a last line sums up.

In float32 every prompt must match to the end. In bf16/fp16 two correct implementations part at a
near-tie, where rounding in another summation order flips the argmax, so a divergence is excused
when transformers' gap there is at most ``--max-tie-gap`` logits, or when it comes at or after
``--min-divergence``. Measured on CPU in bf16 (weir's CPU attention against transformers' SDPA, the
8 prompts below, twice, the same both times, 2026-12-01): prompts 1, 2 and 6 part at positions 17,
34 and 6, with gaps 0.0, 0.125 and 0.0 (ties at bf16 resolution: 0.125 is one bf16 step of a logit between 16 and 32). A
position threshold would have to be at most 6 to pass two correct implementations, so by default
every divergence must be a near-tie (``--min-divergence`` 64, the whole output) of at most 1.0
logit: 8 bf16 steps at that magnitude. An engine made to pick its least likely token parts with the
gap of the logits' whole range, 1.85 even on the flat random-weight model of
``tests/bench/test_greedy_check.py``.

Exit status 1 when any prompt diverges early, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.workloads import DEFAULT_CATALOG, W_GEN_MAX_TOKENS, w_gen_messages

# bf16/fp16 defaults, from the CPU measurement in the module docstring: correct pairs parted at
# positions 6, 17, 34 with gaps 0.0, 0.125, 0.0, so any divergence in the 64 tokens that is no
# near-tie fails; bf16 keeps 8 significant bits (a logit in [16, 32) moves in steps of 0.125, one in
# [32, 64) in steps of 0.25) and both logits of the pair carry such rounding, hence 1.0.
HALF_MIN_DIVERGENCE = W_GEN_MAX_TOKENS
HALF_MAX_TIE_GAP = 1.0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other,
    None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diverged_early(first_divergences: list[int | None], min_divergence: int | None,
                   tie_gaps: list[float | None] | None = None, max_tie_gap: float | None = None) -> list[int]:
    """Indices of the prompts whose first divergence comes before ``min_divergence`` (with None,
    every prompt that diverges at all) and is not a near-tie: a prompt whose ``tie_gaps`` entry is
    at most ``max_tie_gap`` (both given, the entry not None) is excused."""
    early = []
    for i, d in enumerate(first_divergences):
        if d is None or (min_divergence is not None and d >= min_divergence):
            continue
        gap = tie_gaps[i] if tie_gaps is not None else None
        if max_tie_gap is not None and gap is not None and gap <= max_tie_gap:
            continue
        early.append(i)
    return early


@torch.inference_mode()
def tie_gap(hf, prompt: list[int], hf_tokens: list[int], weir_tokens: list[int], device: str) -> float | None:
    """transformers' logit for its own token minus its logit for weir's, at the first position where
    they differ, given the prompt and the tokens both produced before it; None when they do not
    differ or one output is a prefix of the other."""
    d = first_divergence(weir_tokens, hf_tokens)
    if d is None or d >= len(weir_tokens) or d >= len(hf_tokens):
        return None
    ids = torch.tensor([prompt + hf_tokens[:d]], device=device)
    logits = hf(input_ids=ids).logits[0, -1].float()  # [vocab]
    return float(logits[hf_tokens[d]] - logits[weir_tokens[d]])


def weir_greedy(args, dtype: str, max_num_batched_tokens: int) -> tuple[list[list[int]], list[list[int]], list[int], dict]:
    """The prompts' token ids, weir's greedy outputs (up to and including EOS), the EOS ids, and the
    engine's per-mode step counts (``num_steps_cudagraph_full`` ...); the engine's KV pool is
    released before it returns."""
    from weir.engine import LLM, SamplingParams

    from bench.peers import release_engine

    llm = LLM(args.model, dtype=dtype, device=args.device, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, max_num_batched_tokens=max_num_batched_tokens)
    prompts = [llm.encode_prompt(m) for m in w_gen_messages(args.n, args.catalog)]
    eos = sorted(llm.llm_engine.eos_token_ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=W_GEN_MAX_TOKENS))
    steps = {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("num_steps_")}
    release_engine(llm)
    return prompts, [list(o.outputs[0].token_ids) for o in outs], eos, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.greedy_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder; default packaged SmolLM2")
    ap.add_argument("--catalog", default=DEFAULT_CATALOG, help="catalog CSV of the W-gen prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=1024, help="engine argument (tokens)")
    ap.add_argument("--min-divergence", type=int, default=None,
                    help=f"position before which a divergence fails; default: none in float32 (any "
                         f"divergence fails), {HALF_MIN_DIVERGENCE} otherwise")
    ap.add_argument("--max-tie-gap", type=float, default=None,
                    help=f"largest logit gap of a near-tie that excuses an early divergence; default: none "
                         f"in float32, {HALF_MAX_TIE_GAP} otherwise")
    ap.add_argument("--budgets", default="8192",
                    help="comma list of weir's max_num_batched_tokens, one weir run each; one below the "
                         "longest prompt forces chunked prefill beside decodes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    half = dtype not in ("float32", "float")
    min_divergence = args.min_divergence if args.min_divergence is not None or not half else HALF_MIN_DIVERGENCE
    max_tie_gap = args.max_tie_gap if args.max_tie_gap is not None or not half else HALF_MAX_TIE_GAP

    from transformers import AutoModelForCausalLM

    from weir.engine.loader import resolve_model

    runs = {budget: weir_greedy(args, dtype, budget) for budget in budgets}
    prompts, _, eos, _ = runs[budgets[0]]
    too_big = [b for b in budgets if b < max(budgets) and b >= max(map(len, prompts))]
    if too_big:
        raise SystemExit(f"budgets {too_big} hold the longest prompt ({max(map(len, prompts))} tokens): "
                         "no chunked prefill to check")
    src = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, dtype), **src.hf_kwargs())
    hf = hf.to(args.device).eval()
    hf_outs = []
    for p in prompts:
        ids = torch.tensor([p], device=args.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=W_GEN_MAX_TOKENS,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        h = out[0, len(p):].tolist()
        stop = next((j for j, t in enumerate(h) if t in eos), None)
        if stop is not None:  # weir's output ends at its first EOS, included
            h = h[:stop + 1]
        hf_outs.append(h)
    rows = []
    for budget, (_, weir, _, steps) in runs.items():
        for i, (p, w, h) in enumerate(zip(prompts, weir, hf_outs)):
            gap = tie_gap(hf, p, h, w, args.device)
            rows.append({"check": "greedy-equality", "prompt": i, "device": args.device, "dtype": dtype,
                         "max_num_batched_tokens": budget, "prompt_tokens": len(p), "weir_tokens": len(w),
                         "hf_tokens": len(h), "first_divergence": first_divergence(w, h),
                         "tie_gap": None if gap is None else round(gap, 4), **(steps if i == 0 else {})})
    divergences = [r["first_divergence"] for r in rows]
    early = diverged_early(divergences, min_divergence, [r["tie_gap"] for r in rows], max_tie_gap)
    summary = {"check": "greedy-equality-summary", "device": args.device, "dtype": dtype, "budgets": budgets,
               "rows": len(rows),
               "identical": sum(d is None for d in divergences), "first_divergences": divergences,
               "tie_gaps": [r["tie_gap"] for r in rows], "min_divergence": min_divergence,
               "max_tie_gap": max_tie_gap, "diverged_early": early, "passed": not early}
    for row in rows + [summary]:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 1 if early else 0


if __name__ == "__main__":
    raise SystemExit(main())
