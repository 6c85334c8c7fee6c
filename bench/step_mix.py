"""How weir's steps on W-mixed split between full graphs, piecewise graphs and eager, predicted on CPU.

Usage::

    python -m bench.step_mix [--shapes smollm2-135m,llama-1b] [--caps 512,1024,2048] [--json out.jsonl]

The real :class:`weir.engine.scheduler.Scheduler` (with its ``KVCacheManager`` and ``BlockPool``)
schedules the W-mixed requests (``bench.mixed.w_mixed_requests``: all submitted at once, as
``LLM.generate`` does) with a stub forward that returns token 3 for every request whose prompt is
done; each step's runtime mode is :func:`weir.engine.cuda_graphs.dispatch` of that step against the
full graphs' batch sizes (``decode_batch_sizes(max_num_seqs)``) and the piecewise buckets of a cap
(``piecewise_capture_sizes(cap)``). No model runs: the counts are exact for the scheduler as it is,
the KV pool taken as large enough for every request at once (what the H200's ~123 GiB holds for
both shapes).

For each cap it also gives what the capture costs, estimated (:func:`capture_estimate`; CPU cannot
measure CUDA graph memory or capture time) and the predicted device seconds of each mode
(:func:`predict_seconds`), a model with stated constants, not a measurement.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from bench.mixed import SHAPES, w_mixed_requests
from bench.roofline import ModelShape

# Per-step cost model (H200, bf16); constants, not measurements: the GPU run's step_mix rows replace them.
HBM_BYTES_PER_S = 4.3e12  # copy bandwidth (../shared/bench/workloads.md)
MATMUL_FLOPS_PER_S = 790e12 * 0.6  # dense bf16 peak, at the 60 % a mixed-size step's matmuls reach
LAUNCH_S = 6e-6  # host cost of one kernel launch from Python through torch (eager)
KERNELS_PER_LAYER = 14  # norms, q/k/v/o, rotary, KV write, attention, gate/up/act/down, residual adds
REPLAY_S = 12e-6  # host cost of one CUDA graph replay
GRAPH_CAPTURE_S = 4e-3  # one graph's capture after its warm-up run (a few hundred kernels at most)


@dataclass
class _Sizes:
    """Stands in for ``DecodeGraphs`` / ``PiecewiseGraphs`` in ``dispatch``: their sizes only."""

    sizes: list[int]

    def padded_size(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)


def simulate(requests, max_num_seqs: int, max_num_batched_tokens: int, cap: int | None,
             block_size: int = 16) -> list[tuple[str, int, int, int, int]]:
    """Schedule ``requests`` (``(prompt token ids, output length)``) to the end with the real
    scheduler and a stub forward.

    Args:
        cap: the largest piecewise bucket; None: no graphs (every step eager).

    Returns:
        Per step ``(mode, num_tokens, num_reqs, padded_size, context_tokens)``: the runtime mode
        (``full`` / ``piecewise`` / ``eager``), its tokens, its requests, the rows its forward
        computes (padding included) and the tokens of KV its attention reads.
    """
    from weir.engine.block_pool import BlockPool
    from weir.engine.cuda_graphs import FULL, PIECEWISE, decode_batch_sizes, dispatch
    from weir.engine.kv_cache_manager import KVCacheManager
    from weir.engine.piecewise_graphs import piecewise_capture_sizes
    from weir.engine.request import Request
    from weir.engine.sampling_params import SamplingParams
    from weir.engine.scheduler import ModelRunnerOutput, Scheduler

    max_len = max(len(p) + o for p, o in requests)
    num_blocks = sum(-(-(len(p) + o) // block_size) + 1 for p, o in requests)
    scheduler = Scheduler(KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size),
                          max_num_seqs, max_num_batched_tokens, max_len)
    for i, (prompt, num_out) in enumerate(requests):
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=num_out,
                                                                      ignore_eos=True), arrival_time=float(i)))
    full = _Sizes(decode_batch_sizes(max_num_seqs)) if cap else None
    piecewise = _Sizes(piecewise_capture_sizes(min(cap, max_num_batched_tokens))) if cap else None
    steps = []
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        if not sched.scheduled:
            raise RuntimeError("the scheduler scheduled nothing with requests left")
        mode = dispatch(sched, full, piecewise)
        num_reqs, num_tokens = len(sched.scheduled), sched.num_tokens
        padded = (full.padded_size(num_reqs) if mode == FULL else
                  piecewise.padded_size(num_tokens) if mode == PIECEWISE else num_tokens)
        context = sum(s.request.num_computed_tokens + s.num_new_tokens for s in sched.scheduled)
        result = ModelRunnerOutput(sampled={s.request.request_id: 3 for s in sched.scheduled if s.completes_prompt})
        update = scheduler.update(sched, result)
        scheduler.free(update.finished)
        steps.append((mode, num_tokens, num_reqs, padded, context))
    return steps


def summarize(steps) -> dict:
    """``{mode: {"num_steps", "num_tokens", "num_padding_tokens"}}`` over ``simulate``'s steps."""
    out = {m: {"num_steps": 0, "num_tokens": 0, "num_padding_tokens": 0} for m in ("full", "piecewise", "eager")}
    for mode, tokens, _, padded, _ in steps:
        row = out[mode]
        row["num_steps"] += 1
        row["num_tokens"] += tokens
        row["num_padding_tokens"] += padded - tokens
    return out


def predict_seconds(steps, shape: ModelShape, dtype_bytes: int = 2) -> dict:
    """Predicted seconds per mode: ``{"device": {mode: s}, "host": {mode: s}}``.

    Device time of a step: ``max(bytes / HBM_BYTES_PER_S, flops / MATMUL_FLOPS_PER_S)`` with the
    weights read once, the context's KV read once and the padded rows' matmul FLOPs. Host time:
    eager launches ``KERNELS_PER_LAYER`` kernels per layer; piecewise replays ``num_layers + 1``
    graphs and launches attention's 2 kernels per layer; full replays one graph. A step takes
    ``max(device, host)`` (the host runs ahead of the device only when it is faster).
    """
    device = {"full": 0.0, "piecewise": 0.0, "eager": 0.0}
    host = dict(device)
    weights = shape.weight_bytes(dtype_bytes)
    kv = shape.kv_bytes_per_token(dtype_bytes)
    for mode, tokens, num_reqs, padded, context in steps:
        flops = padded * shape.flops_per_token + num_reqs * shape.flops_per_logit_row
        device[mode] += max((weights + kv * context) / HBM_BYTES_PER_S, flops / MATMUL_FLOPS_PER_S)
        host[mode] += {"eager": shape.num_layers * KERNELS_PER_LAYER * LAUNCH_S,
                       "piecewise": (shape.num_layers + 1) * REPLAY_S + shape.num_layers * 2 * LAUNCH_S,
                       "full": REPLAY_S}[mode]
    return {"device": device, "host": host}


def capture_estimate(cap: int, max_num_seqs: int, shape: ModelShape, dtype_bytes: int = 2) -> dict:
    """Estimated cost of capturing the graphs of a piecewise cap (beside the full decode graphs).

    Returns ``num_piecewise_graphs`` (buckets x pieces), ``capture_s`` (every graph of both sets
    times ``GRAPH_CAPTURE_S``, warm-ups included in that constant) and ``pool_bytes``: the shared
    pool holds the largest capture's intermediates, bounded by one layer's activations at the
    largest bucket (q/k/v/o, gate/up and the MLP product, residual and norms), plus the static
    buffers of the largest bucket.
    """
    from weir.engine.cuda_graphs import decode_batch_sizes
    from weir.engine.piecewise_graphs import piecewise_capture_sizes

    buckets = piecewise_capture_sizes(cap)
    num_piecewise = len(buckets) * (shape.num_layers + 1)
    num_full = len(decode_batch_sizes(max_num_seqs))
    width = max(cap, max_num_seqs)
    h, d = shape.hidden_size, shape.head_dim
    per_row = (2 * shape.num_heads * d + 2 * shape.num_kv_heads * d + 3 * shape.intermediate_size + 4 * h)
    return {"num_piecewise_buckets": len(buckets), "num_piecewise_graphs": num_piecewise,
            "num_full_graphs": num_full, "capture_s": round((num_piecewise + num_full) * GRAPH_CAPTURE_S, 2),
            "pool_bytes": width * per_row * dtype_bytes * 2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_mix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--caps", default="512,1024,2048", help="largest piecewise buckets to compare")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bench.mixed import llama_config

    for shape_name in args.shapes.split(","):
        config = llama_config(shape_name, 768)
        shape = ModelShape.from_config(config)
        requests = w_mixed_requests(args.n, SHAPES[shape_name]["vocab_size"])
        for cap in [None] + [int(c) for c in args.caps.split(",")]:
            steps = simulate(requests, args.max_num_seqs, args.max_num_batched_tokens, cap)
            mix = summarize(steps)
            secs = predict_seconds(steps, shape)
            row = {"workload": "W-mixed", "shape": shape_name, "n": args.n, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "cap": cap, "num_steps": len(steps),
                   "step_mix": mix, "predicted_device_s": {k: round(v, 3) for k, v in secs["device"].items()},
                   "predicted_host_s": {k: round(v, 3) for k, v in secs["host"].items()},
                   **({"capture": capture_estimate(cap, args.max_num_seqs, shape)} if cap else {})}
            total = sum(max(secs["device"][m], secs["host"][m]) for m in secs["device"])
            row["predicted_run_s"] = round(total, 3)
            line = " ".join(f"{m} {v['num_steps']}/{v['num_tokens']}" for m, v in mix.items())
            extra = (f" capture ~{row['capture']['capture_s']} s, pool ~{row['capture']['pool_bytes'] / 2**20:.0f} MiB"
                     if cap else "")
            print(f"{shape_name:<14} cap {str(cap or 'eager'):>5}: {len(steps)} steps; steps/tokens {line}; "
                  f"predicted {total:.2f} s{extra}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
