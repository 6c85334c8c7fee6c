"""Greedy equality on dummy weights: weir (CUDA graphs and eager) against transformers, per W-mixed shape.

Usage::

    python -m bench.dummy_check [--shapes smollm2-135m,llama-1b] [--device cuda] [--dtype bfloat16]
                                [--json out.jsonl]
    python -m bench.dummy_check --small [--attention-backend triton]   # CPU rehearsal, tiny shape

Needs no carried model. For each shape of :data:`bench.mixed.SHAPES`, a transformers
``LlamaForCausalLM`` is built with seeded random weights made sharp (:func:`sharpen`: unit-gain
projections, so attention is peaked and every layer counts, and a final norm that spreads the
logits, so the top two logits of a step are rarely within rounding of each other), saved as a
safetensors folder and loaded by weir from it. ``--n`` prompts of random token ids (lengths
uniform in ``--prompt-lens``) are decoded greedily for ``--max-tokens`` tokens, ``ignore_eos``, by:

- ``weir-graphs``: full and piecewise CUDA graphs, ``max_num_batched_tokens`` = ``--graph-budget``
  (below the prompts' total, so prompt chunks run beside decodes through the piecewise graphs);
- ``weir-eager``: ``enforce_eager``, default budget;
- transformers ``generate``, one prompt at a time, unpadded.

Verdict (exit status 1 when any fails; one JSON line per prompt and system, a summary line last):

- each weir system against transformers: a first divergence is excused only at a near-tie,
  transformers' own logit gap there (its token's logit minus weir's token's) at most ``--max-tie-gap``
  (default 2.0 in bf16/fp16, :data:`HALF_TOL`, 1e-3 in float32);
- the two weir systems against each other: up to their first divergence, every sampled token's
  log-probability within ``--logprob-tol`` (default 0.1 nats in bf16/fp16, 1e-4 in float32) of the
  other's where weir-eager's top two are no near-tie; a divergence between them is excused only where weir-eager's top two log-probabilities
  are within ``--max-tie-gap``;
- on CUDA, ``weir-graphs`` must have run steps in both full and piecewise graphs (a run that fell
  back to eager would compare eager with eager).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch

from bench.greedy_check import first_divergence, tie_gap
from bench.mixed import llama_config, w_mixed_requests

FLOAT_TOL = {"max_tie_gap": 1e-3, "logprob_tol": 1e-4}
HALF_TOL = {"max_tie_gap": 2.0, "logprob_tol": 0.1}
"""bf16/fp16: the top logits of these weights lie in [64, 128), where a bf16 step is 0.5, and both
logits of a pair carry rounding: a gap of 4 steps is a near-tie. Measured on CPU in bf16 (smollm2
shape, 4 prompts, 12 tokens): one divergence from transformers, at a gap of 1.0; the graph and
eager runs' sampled-token log-probabilities differed by 0.49 nats at a position whose top two were
close, hence the log-probability tolerance applies where the top two are more than a near-tie apart."""
FINAL_NORM_GAIN = 20.0
"""Final RMSNorm weight: with embeddings of std 0.05 and the normed hidden state of unit scale,
logits have a spread of about ``FINAL_NORM_GAIN * 0.05 * sqrt(hidden_size)`` (24 logits at hidden
576): the top two of a step are then a few logits apart, against a bf16 step of 0.25 there."""


@torch.no_grad()
def sharpen(model, seed: int = 0) -> None:
    """Re-draw a ``LlamaForCausalLM``'s weights in place, seeded: embeddings N(0, 0.05) (tied to the
    lm_head; small beside the layers' outputs, so the next token depends on the layers, not on
    the input token alone), every linear layer N(0, 1 / in_features) (unit gain), layer norms 1,
    the final norm :data:`FINAL_NORM_GAIN`."""
    gen = torch.Generator(device=model.device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=model.device)

    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            p.copy_(randn(p.shape) * 0.05)
        elif p.dim() == 2:
            p.copy_(randn(p.shape) / math.sqrt(p.shape[1]))
        elif name == "model.norm.weight":
            p.fill_(FINAL_NORM_GAIN)
        else:
            p.fill_(1.0)


def save_sharp_model(shape: str, max_positions: int, path: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A sharpened transformers model of a W-mixed shape, built on ``device`` in ``dtype``, saved to
    ``path`` (safetensors) and returned in eval mode."""
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM._from_config(llama_config(shape, max_positions), dtype=dtype).eval()
    sharpen(model, seed)
    model.generation_config.eos_token_id = None  # ignore_eos, as weir runs it
    model.save_pretrained(path)
    return model


def run_weir(path: str, prompts, args, dtype: str, eager: bool) -> tuple[list[list[int]], list[list[dict]], dict]:
    """weir's greedy tokens, per position its top log-probabilities ``{token: logprob}``, and the
    per-mode step counts; the engine's KV pool is released before it returns."""
    from weir.engine import LLM, SamplingParams

    from bench.peers import release_engine

    kwargs = {} if eager else {"max_num_batched_tokens": args.graph_budget}
    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, device=args.device, enforce_eager=eager,
              max_model_len=args.prompt_lens[1] + args.max_tokens, max_num_seqs=max(args.n, 1), **kwargs)
    if args.attention_backend:
        from weir.engine.attention import get_attention_backend

        llm.llm_engine.runner.set_attention_backend(get_attention_backend(args.attention_backend))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    steps = {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("num_steps_")}
    release_engine(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, steps


def hf_greedy(hf, prompts, max_tokens: int, device: str) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, one at a time, no EOS."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def compare_modes(a_tokens, a_logprobs, b_tokens, b_logprobs, logprob_tol: float, max_tie_gap: float) -> list[str]:
    """Why two weir runs of the same prompts disagree, one line each; empty when they agree.

    ``*_logprobs[i][j]`` maps token id -> log-probability at prompt ``i``'s position ``j`` (the
    sampled token and the top two). Up to the first divergence, at each position where ``b``'s top
    two are more than ``max_tie_gap`` apart, the sampled tokens' log-probabilities must be within
    ``logprob_tol``; the divergence itself must be where ``b``'s top two are within ``max_tie_gap``."""
    def top2_gap(position: dict) -> float:
        top = sorted(position.values(), reverse=True)
        return top[0] - top[1] if len(top) > 1 else math.inf

    found = []
    for i, (ta, la, tb, lb) in enumerate(zip(a_tokens, a_logprobs, b_tokens, b_logprobs)):
        d = first_divergence(ta, tb)
        end = len(ta) if d is None else d
        for j in range(end):
            diff = abs(la[j][ta[j]] - lb[j][tb[j]])
            if diff > logprob_tol and top2_gap(lb[j]) > max_tie_gap:
                found.append(f"prompt {i} position {j}: sampled-token logprobs differ by {diff:.4g} > {logprob_tol}")
                break
        if d is not None and d < min(len(ta), len(tb)):
            gap = top2_gap(lb[d])
            if gap > max_tie_gap:
                found.append(f"prompt {i}: modes part at position {d} where the top two are {gap:.4g} apart")
    return found


def check_shape(shape: str, args, dtype: str, emit) -> list[str]:
    """Every verdict line of one shape (module docstring); empty when it passes."""
    max_positions = args.prompt_lens[1] + args.max_tokens
    with tempfile.TemporaryDirectory(prefix=f"weir-dummy-{shape}-") as path:
        hf = save_sharp_model(shape, max_positions, path, args.device, getattr(torch, dtype), args.seed)
        vocab = hf.config.vocab_size
        prompts = [p for p, _ in w_mixed_requests(args.n, vocab, tuple(args.prompt_lens), (1, 1), args.seed)]
        runs = {"weir-graphs": run_weir(path, prompts, args, dtype, eager=False),
                "weir-eager": run_weir(path, prompts, args, dtype, eager=True)}
    hf_tokens = hf_greedy(hf, prompts, args.max_tokens, args.device)
    found = []
    for system, (tokens, _, steps) in runs.items():
        for i, (p, w, h) in enumerate(zip(prompts, tokens, hf_tokens)):
            d = first_divergence(w, h)
            gap = tie_gap(hf, p, h, w, args.device)
            emit({"check": "dummy-greedy", "shape": shape, "system": system, "prompt": i, "dtype": dtype,
                  "prompt_tokens": len(p), "first_divergence": d, "tie_gap": None if gap is None else round(gap, 4)})
            if d is not None and (gap is None or gap > args.max_tie_gap):
                found.append(f"{shape} {system} prompt {i}: parts from transformers at {d}, gap {gap}")
        emit({"check": "dummy-steps", "shape": shape, "system": system, **steps})
    graphs, eager = runs["weir-graphs"], runs["weir-eager"]
    found += [f"{shape} weir-graphs vs weir-eager: {line}" for line in
              compare_modes(graphs[0], graphs[1], eager[0], eager[1], args.logprob_tol, args.max_tie_gap)]
    if torch.device(args.device).type == "cuda":
        steps = graphs[2]
        if not (steps.get("num_steps_cudagraph_full") and steps.get("num_steps_cudagraph_piecewise")):
            found.append(f"{shape} weir-graphs ran no full or no piecewise graph step: {steps}")
    del hf
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dummy_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--n", type=int, default=8, help="prompts per shape")
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[16, 200], help="inclusive range (tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--graph-budget", type=int, default=256, help="weir-graphs' max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "cpu", "triton"],
                    help="force weir's attention backend (CPU rehearsal: triton under TRITON_INTERPRET=1)")
    ap.add_argument("--max-tie-gap", type=float, default=None)
    ap.add_argument("--logprob-tol", type=float, default=None)
    ap.add_argument("--small", action="store_true", help="CPU rehearsal: tiny shape, 4 prompts of 8-40 tokens, "
                                                         "12 tokens, graph budget 32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.small:
        if args.shapes == ap.get_default("shapes"):
            args.shapes = "tiny"
        args.n, args.prompt_lens, args.max_tokens, args.graph_budget = 4, [8, 40], 12, 32
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tol = FLOAT_TOL if dtype in ("float32", "float") else HALF_TOL
    args.max_tie_gap = tol["max_tie_gap"] if args.max_tie_gap is None else args.max_tie_gap
    args.logprob_tol = tol["logprob_tol"] if args.logprob_tol is None else args.logprob_tol
    torch.set_num_threads(os.cpu_count() or 1)

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    found = []
    for shape in args.shapes.split(","):
        found += check_shape(shape, args, dtype, emit)
    emit({"check": "dummy-summary", "shapes": args.shapes.split(","), "dtype": dtype, "device": args.device,
          "max_tie_gap": args.max_tie_gap, "logprob_tol": args.logprob_tol, "problems": found, "passed": not found})
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
