"""Sampler time per step and host syncs per step, before and after the batched sampler.

Usage::

    python -m bench.sampler [--batch 256] [--vocab 49152] [--repeats 5] [--before 95ed8dc]
                            [--device cpu] [--threads N]

Three workloads of ``batch`` rows over random logits of SmolLM2's vocabulary: ``greedy``;
``top_p_logprobs`` (temperature 1.0, top-p 0.9, logprobs=5, unseeded); ``mixed`` (greedy, seeded
and unseeded rows, top-k, top-p, min-p, penalties, min_tokens, logprobs). "Before" is
``engine/sampler.py`` of the ``--before`` revision, read with ``git show`` and loaded as a module
(its ``sample``, and for the sync count its ``ModelRunner._outputs``); "after" is this tree's. The
runs alternate before/after within each repeat; the figures are medians in ms, with the ratio of
each workload to greedy of the same code. Host syncs are counted on ``meta`` tensors with the
dispatch mode of ``tests/engine/test_sampler_devices.py`` (copies to the host plus scalar reads),
per sampler call and for a whole ``_outputs`` step that also holds prompt logprobs and scoring.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from weir.engine import model_runner as model_runner_after
from weir.engine import sampler as sampler_after
from weir.engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def load_before(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(sampler, model_runner) modules of revision ``rev``; its model_runner is executed with
    ``weir.engine.sampler`` bound to that revision's sampler."""
    def module(path: str, name: str) -> types.ModuleType:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True,
                             capture_output=True, text=True).stdout
        mod = types.ModuleType(name)
        mod.__file__ = f"{rev}:{path}"
        sys.modules[name] = mod  # dataclasses look their module up
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        return mod

    sampler = module("engine/sampler.py", "weir_before.sampler")
    current = sys.modules["weir.engine.sampler"]
    sys.modules["weir.engine.sampler"] = sampler
    try:
        runner = module("engine/model_runner.py", "weir_before.model_runner")
    finally:
        sys.modules["weir.engine.sampler"] = current
    return sampler, runner


WORKLOADS = {
    "greedy": [dict(temperature=0)],
    "top_p_logprobs": [dict(temperature=1.0, top_p=0.9, logprobs=5)],
    "mixed": [
        dict(temperature=0),
        dict(temperature=0.7, top_k=50, seed=1),
        dict(temperature=1.0, top_p=0.95, repetition_penalty=1.1),
        dict(temperature=0.9, min_p=0.05, frequency_penalty=0.2, presence_penalty=0.1),
        dict(temperature=1.0, min_tokens=40, max_tokens=64, stop_token_ids=[7], logprobs=2),
        dict(temperature=1.0, top_p=0.9, logprobs=5, seed=2),
    ],
}


def make_rows(sampler, workload: str, batch: int, vocab: int, device: torch.device):
    """``batch`` rows cycling through the workload's parameters: 64 prompt and 32 output tokens
    each; seeded rows get their own generator, the others share one."""
    rng = random.Random(0)
    default = torch.Generator(device=device).manual_seed(0)
    rows = []
    for i in range(batch):
        kw = dict(WORKLOADS[workload][i % len(WORKLOADS[workload])])
        if "seed" in kw:
            kw["seed"] += i
        sp = SamplingParams(**kw)
        gen = (torch.Generator(device=device).manual_seed(sp.seed) if sp.seed is not None
               else None if sp.is_greedy else default)
        rows.append(sampler.SampleRow(sp, gen, [rng.randrange(vocab) for _ in range(64)],
                                      [rng.randrange(vocab) for _ in range(32)], frozenset({2})))
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(sampler, logits: torch.Tensor, workload: str) -> float:
    rows = make_rows(sampler, workload, logits.shape[0], logits.shape[1], logits.device)
    sync(logits.device)
    t0 = time.perf_counter()
    sampler.sample(logits, rows)
    sync(logits.device)
    return (time.perf_counter() - t0) * 1e3


def count_syncs(fn) -> int:
    from tests.engine.test_sampler_devices import HostSyncs

    with HostSyncs(strict=False) as mode:
        fn()
    return mode.num_transfers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", default="95ed8dc")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    before, before_runner = load_before(args.before)
    versions = {"before": before, "after": sampler_after}
    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=device) * 4
    times = {(v, w): [] for v in versions for w in WORKLOADS}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for w in WORKLOADS:
            for v, mod in versions.items():
                times[v, w].append(time_ms(mod, logits, w))
    print(f"sampler per step, batch {args.batch}, vocab {args.vocab}, {device}, "
          f"{torch.get_num_threads()} CPU threads, median of {args.repeats}")
    print(f"{'workload':16} {'before ms':>10} {'after ms':>10} {'speed-up':>9} {'before/greedy':>14} "
          f"{'after/greedy':>13} {'syncs before':>13} {'syncs after':>12}")
    med = {k: statistics.median(t[1:]) for k, t in times.items()}
    meta = torch.zeros(args.batch, args.vocab, device="meta")
    for w in WORKLOADS:
        syncs = [count_syncs(lambda: mod.sample(meta, make_rows(mod, w, args.batch, args.vocab, torch.device("cpu"))))
                 for mod in versions.values()]
        print(f"{w:16} {med['before', w]:10.2f} {med['after', w]:10.2f} {med['before', w] / med['after', w]:8.2f}x "
              f"{med['before', w] / med['before', 'greedy']:13.2f}x {med['after', w] / med['after', 'greedy']:12.2f}x "
              f"{syncs[0]:13d} {syncs[1]:12d}")
    from tests.engine.test_sampler_devices import MetaModel, mixed_step

    def outputs(runner_cls):
        scheduled, num_tokens = mixed_step()
        runner = types.SimpleNamespace(model=MetaModel(32, 8), structured_outputs=None)
        return lambda: runner_cls._outputs(runner, scheduled, torch.zeros(num_tokens, 8, device="meta"))

    steps = [count_syncs(outputs(m.ModelRunner)) for m in (before_runner, model_runner_after)]
    print(f"host syncs in one _outputs step (6 generation rows, prompt logprobs, scoring): "
          f"before {steps[0]}, after {steps[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
