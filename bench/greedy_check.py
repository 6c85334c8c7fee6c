"""Greedy equality: weir's engine against transformers on real weights, same device and dtype.

Usage::

    python -m bench.greedy_check [--n 8] [--device cuda] [--dtype bfloat16] [--min-divergence 8]
                                 [--json out.jsonl]

Each of the first ``n`` W-gen catalog prompts is decoded greedily (``max_tokens`` 64, stop at EOS)
by weir (all prompts batched together) and by transformers ``generate`` (one prompt at a time,
unpadded). One JSON line per prompt gives the first position where the token ids differ (null when
they are equal); a last line sums up. In bf16 the two may part after a near-tie in the logits:
the kernels sum in a different order than transformers' attention, so the position is the figure.

The check states the earliest position at which the two may part (``--min-divergence``; default
none in float32, where every prompt must match to the end, and 8 in fp16/bf16) and exits 1 when
any prompt diverges before it, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.workloads import W_GEN_MAX_TOKENS, w_gen_messages


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other,
    None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diverged_early(first_divergences: list[int | None], min_divergence: int | None) -> list[int]:
    """Indices of the prompts whose first divergence comes before ``min_divergence`` (with None,
    every prompt that diverges at all)."""
    return [i for i, d in enumerate(first_divergences)
            if d is not None and (min_divergence is None or d < min_divergence)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.greedy_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder; default packaged SmolLM2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--min-divergence", type=int, default=None,
                    help="earliest position the outputs may part at; default: none in float32, 8 otherwise")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    min_divergence = args.min_divergence
    if min_divergence is None and dtype not in ("float32", "float"):
        min_divergence = 8

    from transformers import AutoModelForCausalLM

    from weir.engine import LLM, SamplingParams
    from weir.engine.loader import resolve_model

    llm = LLM(args.model, dtype=dtype, device=args.device, max_model_len=1024, enforce_eager=args.enforce_eager)
    prompts = [llm.encode_prompt(m) for m in w_gen_messages(args.n)]
    eos = sorted(llm.llm_engine.eos_token_ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=W_GEN_MAX_TOKENS))
    weir = [list(o.outputs[0].token_ids) for o in outs]
    del llm

    src = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, dtype), **src.hf_kwargs())
    hf = hf.to(args.device).eval()
    rows = []
    for i, (p, w) in enumerate(zip(prompts, weir)):
        ids = torch.tensor([p], device=args.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=W_GEN_MAX_TOKENS,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        h = out[0, len(p):].tolist()
        stop = next((j for j, t in enumerate(h) if t in eos), None)
        if stop is not None:  # weir's output ends at its first EOS, included
            h = h[:stop + 1]
        rows.append({"check": "greedy-equality", "prompt": i, "device": args.device, "dtype": dtype,
                     "prompt_tokens": len(p), "weir_tokens": len(w), "hf_tokens": len(h),
                     "first_divergence": first_divergence(w, h)})
    divergences = [r["first_divergence"] for r in rows]
    early = diverged_early(divergences, min_divergence)
    summary = {"check": "greedy-equality-summary", "device": args.device, "dtype": dtype, "prompts": len(rows),
               "identical": sum(d is None for d in divergences), "first_divergences": divergences,
               "min_divergence": min_divergence, "diverged_early": early, "passed": not early}
    for row in rows + [summary]:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 1 if early else 0


if __name__ == "__main__":
    raise SystemExit(main())
