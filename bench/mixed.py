"""W-mixed benchmark: weir against HF static and HF continuous batching, measured in the same run.

Usage::

    python -m bench.mixed [--shapes smollm2-135m,llama-1b] [--n 512] [--json out.jsonl]
    python -m bench.mixed --small            # CPU smoke: 16 short requests, tiny and smollm2 shapes

Workload (``../shared/bench/workloads.md``): ``n`` requests, seed 0, prompts of random token ids
with length uniform in [64, 512], output length uniform in [16, 256], ``ignore_eos``, greedy, dummy
(random) weights, bf16 on CUDA. Metric: output tokens per second = sum of requested output lengths
/ wall time. Each system must have generated every requested token (each request's own count for
weir and HF continuous batching, at least that many for HF static): otherwise the run prints why
and exits 1. HF static runs left-padded batches to the longest requested output of each batch; HF
continuous batching gets each request's own ``max_new_tokens``.

Roofline: the run measures the device's dense matmul rate and copy bandwidth, counts the
workload's FLOPs and its least state traffic (:func:`bench.roofline.generation_flops`,
:func:`bench.roofline.generation_bytes`), and prints each system's fraction of
``max(flops / matmul_rate, bytes / bandwidth)``, and also of the compute bound and of the bandwidth
bound alone. Weir's row carries, for its last timed run, the steps, tokens, host time (issuing the
forward) and GPU time (CUDA events) of each graph mode. weir's KV pool is released before the peers
run (:func:`bench.peers.release_engine`). The peers are :mod:`bench.peers`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from bench.peers import (check_generated, hf_continuous_batching, hf_model_from_config, hf_static_generate,
                         release_engine, synchronize)
from bench.report import GRAPH_MODES, Report, cudagraph_share_line, cudagraph_shares
from bench.roofline import ModelShape, generation_bytes, generation_flops

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512),
}


def llama_config(shape: str, max_positions: int):
    """A ``LlamaConfig`` of one W-mixed model shape (tied embeddings, bos 1, eos 2)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max_positions,
                       bos_token_id=1, eos_token_id=2, rope_theta=10000.0)


def w_mixed_requests(n: int, vocab_size: int, prompt_lens=(64, 512), output_lens=(16, 256),
                     seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` pairs (prompt token ids, output length), lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt_lens)
        out.append(([rng.randrange(3, vocab_size) for _ in range(p)], rng.randint(*output_lens)))
    return out


# ---- roofline -------------------------------------------------------------------------------------


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict:
    """Dense matmul FLOP/s and copy bandwidth (bytes read + written per second) of this device."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def best(fn, reps):
        fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    mm = best(lambda: a @ b, 10)
    cp = best(lambda: dst.copy_(src), 10)
    return {"matmul_flops_per_s": 2 * n ** 3 / mm, "copy_bytes_per_s": 2 * size / cp}


# ---- systems ----------------------------------------------------------------------------------------


STEP_MIX_KEYS = ("num_steps", "num_tokens", "num_padding_tokens", "forward_host_time_s", "forward_gpu_time_s")


def step_mix(before: dict, after: dict) -> dict:
    """Per graph mode, the difference of ``LLMEngine.stats()`` counters between two readings:
    ``{mode: {"num_steps": .., "num_tokens": .., "num_padding_tokens": .., "forward_host_time_s": ..,
    "forward_gpu_time_s": .. (only where measured)}}``, modes as in ``bench.report.GRAPH_MODES``."""
    out = {}
    for mode in GRAPH_MODES:
        row = {}
        for key in STEP_MIX_KEYS:
            name = f"{key}_{mode}"
            if name in after:
                value = after[name] - before.get(name, 0)
                row[key] = round(value, 4) if isinstance(value, float) else value
        out[mode] = row
    return out


def step_mix_line(mix: dict, wall_s: float) -> str:
    """One report line: steps per mode, and forward host and GPU seconds against the run's wall time."""
    parts = []
    for mode, row in mix.items():
        gpu = row.get("forward_gpu_time_s")
        parts.append(f"{mode} {row['num_steps']} steps, host {row['forward_host_time_s']:.2f} s"
                     + (f", GPU {gpu:.2f} s" if gpu is not None else ""))
    return f"{'weir step mix':<24} " + "; ".join(parts) + f" (wall {wall_s:.2f} s)"


def run_weir(config, requests, args, dtype: str) -> tuple[float, list[int], dict]:
    from weir.engine import LLM, SamplingParams

    llm = LLM(config, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=config.max_position_embeddings, enforce_eager=args.enforce_eager,
              max_cudagraph_capture_size=args.max_cudagraph_capture_size,
              measure_step_gpu_time=args.device == "cuda")
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts[:4]))
    times = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        before = llm.llm_engine.stats()
        synchronize(args.device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t)
    generated = [len(o.outputs[0].token_ids) for o in outs]
    stats = llm.llm_engine.stats()
    mix = step_mix(before, stats)  # the last timed run only
    print(step_mix_line(mix, times[-1]), flush=True)
    extra = {"step_mix": mix}
    if args.device == "cuda":  # every run's steps, the warm-up's included
        print(cudagraph_share_line(stats), flush=True)
        extra["cudagraph_shares"] = cudagraph_shares(stats)
    # the peers run next in this process: weir's KV pool and graphs go first
    release_engine(llm)
    del llm
    _free(args.device)
    return statistics.median(times), generated, {"num_gpu_blocks": stats.get("num_gpu_blocks"),
                                                 "num_preemptions": stats.get("num_preemptions"),
                                                 "repeats_s": [round(x, 3) for x in times], **extra}


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- main -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mixed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--n", type=int, default=512, help="requests")
    ap.add_argument("--systems", default="weir,hf-static,hf-cb")
    ap.add_argument("--batch-sizes", default="64,256", help="HF static batch sizes")
    ap.add_argument("--repeats", type=int, default=3, help="weir runs (median reported)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true", help="weir without CUDA graphs")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                    help="weir's largest piecewise bucket (tokens; default the engine's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true",
                    help="CPU smoke: 16 requests, prompts 8-48, outputs 4-24, tiny and smollm2 shapes, "
                         "HF static batch 8/16, one weir repeat")
    ap.add_argument("--json", default=None, help="append one JSON line per figure to this file")
    args = ap.parse_args(argv)
    prompt_lens, output_lens = (64, 512), (16, 256)
    if args.small:
        args.n, args.repeats, args.max_num_seqs, args.max_num_batched_tokens = 16, 1, 16, 512
        prompt_lens, output_lens = (8, 48), (4, 24)
        if args.shapes == ap.get_default("shapes"):
            args.shapes = "tiny,smollm2-135m"
        if args.batch_sizes == ap.get_default("batch_sizes"):
            args.batch_sizes = "8,16"
    device = torch.device(args.device)
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    systems = args.systems.split(",")
    peaks = measure_peaks(device, dtype)
    print(f"device {device} {dtype_name}: matmul {peaks['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, "
          f"copy {peaks['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)

    report = Report(args.json)
    failures: list[str] = []

    for shape in args.shapes.split(","):
        config = llama_config(shape, max_positions=prompt_lens[1] + output_lens[1])
        requests = w_mixed_requests(args.n, config.vocab_size, prompt_lens, output_lens)
        requested = sum(o for _, o in requests)
        model_shape = ModelShape.from_config(config)
        dtype_bytes = torch.empty(0, dtype=dtype).element_size()
        flops = generation_flops(model_shape, [(len(p), 0, o) for p, o in requests]).flops
        state_bytes = generation_bytes(model_shape, [(len(p), o) for p, o in requests], dtype_bytes)
        compute_s, bandwidth_s = flops / peaks["matmul_flops_per_s"], state_bytes / peaks["copy_bytes_per_s"]
        roof_s = max(compute_s, bandwidth_s)
        base = {"workload": "W-mixed", "shape": shape, "n": args.n, "device": str(device), "dtype": dtype_name,
                "output_tokens": requested, "roofline_s": round(roof_s, 4), "compute_bound_s": round(compute_s, 4),
                "bandwidth_bound_s": round(bandwidth_s, 4), "flops": flops,
                "state_bytes": state_bytes, **{k: round(v) for k, v in peaks.items()}}
        rows = []
        wanted = [o for _, o in requests]

        def add(system, secs, generated, exact=True, **extra):
            short = check_generated(system, wanted, generated, exact)
            failures.extend(short)
            row = {**base, "system": system, "seconds": round(secs, 3), "tok_per_s": round(requested / secs, 1),
                   "generated_tokens": sum(generated), "all_generated": not short,
                   "roofline_fraction": round(roof_s / secs, 4),
                   "compute_bound_fraction": round(compute_s / secs, 4),
                   "bandwidth_bound_fraction": round(bandwidth_s / secs, 4), **extra}
            rows.append(row)
            report.emit(json.dumps(row), **row)
            for line in short:
                print("NOT GENERATED:", line, flush=True)

        if "weir" in systems:
            secs, generated, extra = run_weir(config, requests, args, dtype_name)
            add("weir", secs, generated, enforce_eager=args.enforce_eager, **extra)
        if "hf-static" in systems or "hf-cb" in systems:
            hf = hf_model_from_config(config, dtype, args.device)
            if "hf-static" in systems:
                hf_static_generate(hf, requests[:2], 2, eos=())  # warm-up
                for bs in [int(b) for b in args.batch_sizes.split(",")]:
                    try:
                        secs, outs = hf_static_generate(hf, requests, bs, eos=())
                        add(f"hf-static-bs{bs}", secs, [len(out) for out in outs], exact=False)
                    except torch.OutOfMemoryError as e:  # the peer's own failure is reported
                        error = {**base, "system": f"hf-static-bs{bs}", "error": f"OutOfMemoryError: {e}"[:300]}
                        report.emit(json.dumps(error), **error)
                        _free(args.device)
            if "hf-cb" in systems:
                try:
                    secs, outs = hf_continuous_batching(hf, requests, eos=())
                    add("hf-continuous-batching", secs, [len(out) for out in outs])
                except Exception as e:  # the peer's own failure is reported, not hidden
                    error = {**base, "system": "hf-continuous-batching", "error": f"{type(e).__name__}: {e}"[:300]}
                    report.emit(json.dumps(error), **error)
            del hf
            _free(args.device)
        weir = next((r for r in rows if r["system"] == "weir"), None)
        print(f"--- W-mixed {shape}: {args.n} requests, {requested} output tokens, roofline {roof_s:.3f} s")
        for r in rows:
            ratio = f"  weir x{weir['tok_per_s'] / r['tok_per_s']:.2f}" if weir and r is not weir else ""
            print(f"{r['system']:<24} {r['seconds']:>8.2f} s {r['tok_per_s']:>10.1f} tok/s  "
                  f"{100 * r['roofline_fraction']:5.1f}% of roofline (compute-only "
                  f"{100 * r['compute_bound_fraction']:.1f}%, bandwidth-only "
                  f"{100 * r['bandwidth_bound_fraction']:.1f}%){ratio}", flush=True)
        if weir:
            ratios = {f"weir_over_{r['system']}": round(weir["tok_per_s"] / r["tok_per_s"], 3)
                      for r in rows if r is not weir}
            row = {**base, "system": "ratios", **ratios}
            report.emit(json.dumps(row), **row)
    if failures:
        print(f"W-mixed: {len(failures)} lines of tokens counted but not generated", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
