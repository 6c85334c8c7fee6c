"""W-gen benchmark: weir's engine against transformers peers, measured in the same run.

Usage::

    weir bench [--n 64] [--batch-sizes 8,16,32,64] [--systems weir,hf-static,hf-cb] [--json out.jsonl]

Metric: useful generated tokens (up to and including EOS) per second of wall time, prefill
included, model already loaded and warmed up. Prints one line per system and weir's ratio to each.
Also prints each system's achieved GFLOP/s of model math (useful work: prefix-cache hits excluded
for weir, padding and tokens past EOS excluded for HF) against this machine's measured matmul peak
(:mod:`bench.roofline`). The peers are :mod:`bench.peers`; weir's KV pool is released before they
run. Each system must return a non-empty output, ending at EOS or at ``max_tokens``, for every
request (the tokens counted are the tokens generated): otherwise the run says which and exits 1. W-cls is ``weir bench cls`` (:mod:`bench.cls`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.peers import (check_stopped, hf_continuous_batching, hf_static_generate, load_hf_model, pad_token_id, release_engine,
                         useful_tokens)
from bench.report import Report, matmul_peak_line
from bench.roofline import ModelShape, format_rate, generation_flops, matmul_peak
from bench.workloads import W_GEN_MAX_TOKENS, w_gen_messages


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

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(64, args.n), max_model_len=1024)
    prompts = [llm.encode_prompt(m) for m in w_gen_messages(args.n)]
    eos = set(llm.llm_engine.eos_token_ids)
    shape = ModelShape.from_config(llm.llm_engine.config)
    peak = matmul_peak(shape, llm.llm_engine.dtype, str(llm.llm_engine.device))["peak"]
    print(matmul_peak_line(peak), flush=True)
    out = Report(args.json, workload="W-gen", n=args.n)

    failures: list[str] = []

    def check(system, outputs):
        failures.extend(check_stopped(system, outputs, eos, W_GEN_MAX_TOKENS))

    def report(system, toks, secs, flops=None, **extra):
        row = {"system": system, "useful_tokens": toks, "seconds": round(secs, 3),
               "tok_per_s": round(toks / secs, 2), **extra}
        if flops is not None:
            row.update(model_gflops_per_s=round(flops / secs / 1e9, 2), matmul_peak_gflops=round(peak, 1),
                       fraction_of_matmul_peak=round(flops / secs / 1e9 / peak, 4))
        out.emit(f"{system:<24} {toks:>6} tokens {secs:>8.2f} s {toks / secs:>9.1f} tok/s", **row)
        if flops is not None:
            print(format_rate(system, flops, secs, peak), flush=True)

    weir_outs = None
    if "weir" in systems:
        toks, secs, weir_outs, outs = run_weir(llm, prompts, args.repeats)
        # weir's model math: prompt tokens served from the prefix cache are not computed
        fc = generation_flops(shape, [(len(o.prompt_token_ids), o.num_cached_tokens, len(o.outputs[0].token_ids))
                                      for o in outs])
        check("weir", weir_outs)
        report("weir", toks, secs, fc.flops, stats=llm.stats())
    pad_id = pad_token_id(llm.tokenizer)
    release_engine(llm)  # the peers get the card weir had
    if "hf-static" in systems or "hf-cb" in systems:
        hf = load_hf_model(args.model, getattr(torch, args.dtype), args.device)
        requests = [(p, W_GEN_MAX_TOKENS) for p in prompts]
        if "hf-static" in systems:
            hf_static_generate(hf, requests[:2], 2, eos, pad_id)  # warm-up
            for bs in [int(b) for b in args.batch_sizes.split(",")]:
                secs, rows = hf_static_generate(hf, requests, bs, eos, pad_id)
                outs = [row[:useful_tokens(row, eos)] for row in rows]
                check(f"hf-static-bs{bs}", outs)
                same = sum(a == b for a, b in zip(outs, weir_outs)) if weir_outs else None
                # useful work only: padded positions and tokens past EOS are wasted
                fc = generation_flops(shape, [(len(p), 0, len(o)) for p, o in zip(prompts, outs)])
                report(f"hf-static-bs{bs}", sum(map(len, outs)), secs, fc.flops, same_tokens_as_weir=same)
        if "hf-cb" in systems:
            try:
                secs, rows = hf_continuous_batching(hf, requests, eos, pad_id)
                lens = [useful_tokens(row, eos) for row in rows]
                check("hf-continuous-batching", [row[:n] for row, n in zip(rows, lens)])
                fc = generation_flops(shape, [(len(p), 0, n) for p, n in zip(prompts, lens)])
                report("hf-continuous-batching", sum(lens), secs, fc.flops)
            except Exception as e:  # the peer's own failure is reported, not hidden
                print(f"hf-continuous-batching failed: {type(e).__name__}: {e}")
    results = out.rows
    weir = next((r for r in results if r["system"] == "weir"), None)
    if weir:
        static = [r for r in results if r["system"].startswith("hf-static")]
        if static:
            best = max(static, key=lambda r: r["tok_per_s"])
            print(f"weir / best HF static ({best['system']}): {weir['tok_per_s'] / best['tok_per_s']:.2f}x")
        for r in results:
            if r["system"] == "hf-continuous-batching":
                print(f"weir / HF continuous batching: {weir['tok_per_s'] / r['tok_per_s']:.2f}x")
    for line in failures:
        print("NOT GENERATED:", line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
