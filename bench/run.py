"""W-gen benchmark: weir's engine against transformers peers, measured in the same run.

Usage::

    weir bench [--n 64] [--batch-sizes 8,16,32,64] [--systems weir,hf-static,hf-cb] [--json out.jsonl]

Metric: useful generated tokens (up to and including EOS) per second of wall time, prefill
included, model already loaded and warmed up. Prints one line per system and weir's ratio to each.
Also prints each system's achieved GFLOP/s of model math (useful work: prefix-cache hits excluded
for weir, padding and tokens past EOS excluded for HF) against this machine's measured matmul peak
(:mod:`bench.roofline`). W-cls is ``weir bench cls`` (:mod:`bench.cls`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.roofline import ModelShape, format_rate, generation_flops, matmul_peak
from bench.workloads import W_GEN_MAX_TOKENS, w_gen_messages


def useful_tokens(ids: list[int], eos: set[int]) -> int:
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


def run_weir(llm, prompts, repeats):
    from weir.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=W_GEN_MAX_TOKENS)
    llm.generate(prompts[:2], sp)  # warm-up
    times, toks = [], 0
    for _ in range(repeats):
        # every repeat starts cold: only prefixes shared within the run are served from cache
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        times.append(time.perf_counter() - t)
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return toks, statistics.median(times), [o.outputs[0].token_ids for o in outs], outs


def run_hf_static(hf, prompts, batch_size, eos, pad_id):
    t = time.perf_counter()
    toks, outs = 0, []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=W_GEN_MAX_TOKENS, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=pad_id)
        for row in out[:, width:].tolist():
            n = useful_tokens(row, eos)
            toks += n
            outs.append(row[:n])
    return toks, time.perf_counter() - t, outs


def run_hf_cb(hf, prompts, eos, pad_id):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=W_GEN_MAX_TOKENS, do_sample=False, eos_token_id=sorted(eos),
                          pad_token_id=pad_id)
    t = time.perf_counter()
    with torch.inference_mode():
        res = hf.generate_batch(prompts, generation_config=gc, progress_bar=False)
    dt = time.perf_counter() - t
    lens = [(len(r.prompt_ids), useful_tokens(list(r.generated_tokens), eos)) for r in res.values()]
    return sum(n for _, n in lens), dt, lens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="weir bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="catalog rows (64 on CPU, 1024 on GPU)")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder; default packaged SmolLM2")
    ap.add_argument("--batch-sizes", default="8,16,32,64", help="HF static batch sizes to try")
    ap.add_argument("--systems", default="weir,hf-static,hf-cb")
    ap.add_argument("--repeats", type=int, default=1, help="weir runs (median reported)")
    ap.add_argument("--json", default=None, help="append one JSON line per figure to this file")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every system runs there)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (every system)")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    systems = args.systems.split(",")

    from weir.engine import LLM
    from weir.engine.loader import resolve_model

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(64, args.n), max_model_len=1024)
    prompts = [llm.encode_prompt(m) for m in w_gen_messages(args.n)]
    eos = set(llm.llm_engine.eos_token_ids)
    results = []
    shape = ModelShape.from_config(llm.llm_engine.config)
    peak = matmul_peak(shape, llm.llm_engine.dtype, str(llm.llm_engine.device))["peak"]
    print(f"{'matmul peak':<24} {peak:>8.1f} GFLOP/s", flush=True)

    def report(system, toks, secs, flops=None, **extra):
        row = {"workload": "W-gen", "n": args.n, "system": system, "useful_tokens": toks,
               "seconds": round(secs, 3), "tok_per_s": round(toks / secs, 2), **extra}
        if flops is not None:
            row.update(model_gflops_per_s=round(flops / secs / 1e9, 2), matmul_peak_gflops=round(peak, 1),
                       fraction_of_matmul_peak=round(flops / secs / 1e9 / peak, 4))
        results.append(row)
        print(f"{system:<24} {toks:>6} tokens {secs:>8.2f} s {toks / secs:>9.1f} tok/s", flush=True)
        if flops is not None:
            print(format_rate(system, flops, secs, peak), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    weir_outs = None
    if "weir" in systems:
        toks, secs, weir_outs, outs = run_weir(llm, prompts, args.repeats)
        # weir's model math: prompt tokens served from the prefix cache are not computed
        fc = generation_flops(shape, [(len(o.prompt_token_ids), o.num_cached_tokens, len(o.outputs[0].token_ids))
                                      for o in outs])
        report("weir", toks, secs, fc.flops, stats=llm.stats())
    if "hf-static" in systems or "hf-cb" in systems:
        from transformers import AutoModelForCausalLM

        src = resolve_model(args.model)
        hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, args.dtype),
                                                  **src.hf_kwargs()).to(args.device).eval()
        pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
        if "hf-static" in systems:
            run_hf_static(hf, prompts[:2], 2, eos, pad_id)  # warm-up
            for bs in [int(b) for b in args.batch_sizes.split(",")]:
                toks, secs, outs = run_hf_static(hf, prompts, bs, eos, pad_id)
                same = sum(a == b for a, b in zip(outs, weir_outs)) if weir_outs else None
                # useful work only: padded positions and tokens past EOS are wasted
                fc = generation_flops(shape, [(len(p), 0, len(o)) for p, o in zip(prompts, outs)])
                report(f"hf-static-bs{bs}", toks, secs, fc.flops, same_tokens_as_weir=same)
        if "hf-cb" in systems:
            try:
                toks, secs, lens = run_hf_cb(hf, prompts, eos, pad_id)
                fc = generation_flops(shape, [(p, 0, n) for p, n in lens])
                report("hf-continuous-batching", toks, secs, fc.flops)
            except Exception as e:  # the peer's own failure is reported, not hidden
                print(f"hf-continuous-batching failed: {type(e).__name__}: {e}")
    weir = next((r for r in results if r["system"] == "weir"), None)
    if weir:
        static = [r for r in results if r["system"].startswith("hf-static")]
        if static:
            best = max(static, key=lambda r: r["tok_per_s"])
            print(f"weir / best HF static ({best['system']}): {weir['tok_per_s'] / best['tok_per_s']:.2f}x")
        for r in results:
            if r["system"] == "hf-continuous-batching":
                print(f"weir / HF continuous batching: {weir['tok_per_s'] / r['tok_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
