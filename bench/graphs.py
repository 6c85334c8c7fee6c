"""W-queue: the steps a queue-fed engine makes (prefill chunks next to running decodes), before and
after piecewise CUDA graphs, measured in the same run.

Usage::

    python -m bench.graphs [--before 95ed8dc] [--shape smollm2-135m] [--n 64] [--repeats 3]
    python -m bench.graphs --small     # CPU smoke: tiny shape, 12 requests, one repeat

Workload: ``n`` requests, seed 0, prompts of random token ids with length uniform in [64, 512],
output length uniform in [16, 128], greedy, ``ignore_eos``, dummy weights (bf16 on CUDA), prefix
caching off. They reach ``LLMEngine`` as from a queue: ``--initial`` at once, then one more every
``--arrive-every`` steps, so most steps hold a prefill chunk beside the running decodes. Metric:
engine steps per second and output tokens per second over the whole run (median of
``--repeats``), for three systems, each in its own subprocess, alternating by repeat:

- ``before``: the engine at ``--before`` (full CUDA graphs for decode-only steps, else eager);
- ``after``: this tree (``FULL_AND_PIECEWISE``);
- ``after-eager``: this tree with ``enforce_eager``.

Prints the ratios to ``before`` and, on CUDA, the share of steps and of GPU time under a graph.
The ``before`` tree is ``git archive``d into a temporary folder and imported there as ``weir``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "jobs", "kernels", "migrations", "worker")


def package_root(tree: Path, dest: Path) -> Path:
    """A folder that imports ``tree`` as ``weir`` (``weir/`` copied, the top-level package folders
    linked in as ``weir.engine`` ...), as the installed package maps them."""
    root = dest / "root"
    root.mkdir()
    shutil.copytree(tree / "weir", root / "weir")
    for name in PACKAGES:
        if (tree / name).is_dir():
            (root / "weir" / name).symlink_to(tree / name)
    return root


def workload(n: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(64, 512))], rng.randint(16, 128))
            for _ in range(n)]


def worker(cfg: dict) -> dict:
    """One system's run in this process: the queue-fed loop, timed; returns its figures."""
    import torch

    import weir.engine
    from bench.mixed import llama_config
    from weir.engine.engine_args import EngineArgs
    from weir.engine.llm_engine import LLMEngine
    from weir.engine.sampling_params import SamplingParams

    config = llama_config(cfg["shape"], max_positions=512 + 128 + 1)
    kw = dict(model=config, load_format="dummy", skip_tokenizer_init=True, device=cfg["device"],
              max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
              enable_prefix_caching=False, enforce_eager=cfg["enforce_eager"])
    if cfg["measure_gpu_time"]:
        kw["measure_step_gpu_time"] = True
    engine = LLMEngine(EngineArgs(**kw))
    requests = workload(cfg["n"], config.vocab_size)

    def run(reqs) -> tuple[float, int, int]:
        pending = list(reqs)
        num_steps = num_tokens = 0
        if cfg["device"] == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while pending or engine.has_unfinished():
            arrivals = cfg["initial"] if num_steps == 0 else int(num_steps % cfg["arrive_every"] == 0)
            for prompt, out in pending[:arrivals]:
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            del pending[:arrivals]
            for o in engine.step():
                num_tokens += len(o.outputs[0].token_ids)
            num_steps += 1
        return time.perf_counter() - t0, num_steps, num_tokens

    run(requests[:4])  # warm-up: kernels compiled, allocator filled
    stats0 = engine.stats()
    secs, num_steps, num_tokens = run(requests)
    stats = engine.stats()
    # the timed run's own counters: the warm-up's subtracted
    diff = {k: v - stats0.get(k, 0) for k, v in stats.items()
            if k.startswith(("num_steps_", "num_tokens_", "forward_")) and isinstance(v, (int, float))}
    return {"seconds": secs, "num_steps": num_steps, "output_tokens": num_tokens, "graph_stats": diff,
            "engine_dir": str(Path(weir.engine.__file__).resolve().parent)}


def run_system(name: str, root: Path, cfg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
    code = "import json, sys; from bench.graphs import worker; print(json.dumps(worker(json.loads(sys.argv[1]))))"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env, cwd=root, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.graphs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="95ed8dc", help="git revision of the 'before' engine")
    ap.add_argument("--shape", default="smollm2-135m", help="a shape of bench.mixed.SHAPES")
    ap.add_argument("--n", type=int, default=64, help="requests")
    ap.add_argument("--initial", type=int, default=8, help="requests queued at the first step")
    ap.add_argument("--arrive-every", type=int, default=4, help="steps between two later arrivals")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--small", action="store_true", help="CPU smoke: tiny shape, 12 requests, one repeat")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.small:
        args.shape, args.n, args.repeats, args.initial = "tiny", 12, 1, 4
    cfg = {"shape": args.shape, "n": args.n, "initial": args.initial, "arrive_every": args.arrive_every,
           "device": device, "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp) / "before"
        before_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive.stdout, check=True)
        (Path(tmp) / "b").mkdir()
        (Path(tmp) / "a").mkdir()
        roots = {"before": package_root(before_tree, Path(tmp) / "b"), "after": package_root(REPO, Path(tmp) / "a")}
        systems = {"before": ("before", False, False), "after": ("after", False, device == "cuda"),
                   "after-eager": ("after", True, False)}
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for _ in range(args.repeats):
            for name, (tree, eager, gpu_time) in systems.items():
                runs[name].append(run_system(name, roots[tree], {**cfg, "enforce_eager": eager,
                                                                 "measure_gpu_time": gpu_time}))
    print(f"--- W-queue {args.shape} on {device}: {args.n} requests, {args.initial} at once then one every "
          f"{args.arrive_every} steps, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"{args.repeats} repeats (medians)")
    medians = {}
    for name, rs in runs.items():
        secs = statistics.median(r["seconds"] for r in rs)
        r = rs[0]
        medians[name] = secs
        print(f"{name:<12} {secs:8.2f} s {r['num_steps'] / secs:9.1f} steps/s "
              f"{r['output_tokens'] / secs:10.1f} tok/s  ({r['num_steps']} steps; engine from {r['engine_dir']})",
              flush=True)
    for name in ("after", "after-eager"):
        print(f"{name} / before: x{medians['before'] / medians[name]:.2f} (time ratio before/{name})")
    stats = runs["after"][-1]["graph_stats"]
    if device == "cuda" and stats:
        from bench.report import cudagraph_share_line

        print(cudagraph_share_line(stats))
    print(json.dumps({"workload": "W-queue", **cfg, "medians_s": medians,
                      "after_graph_stats": stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
