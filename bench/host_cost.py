"""The engine's host cost per job: Python and dispatch around the model, per classify job and per
one-token generation, at a batch of 256.

    python -m bench.host_cost                      # 2,048 jobs of each kind, max_num_seqs 256
    python -m bench.host_cost --jobs 4096 --max-num-seqs 64

The offline ``LLM`` on :func:`weir.jobs.testing.save_tiny_chat_model` (random weights, 2 layers,
hidden size 64, SmolLM2's tokenizer and 49,152-token vocabulary), CPU, torch's default threads.
Prompts are token ids (8-23 tokens, so tokenizing is not counted; the worker encodes a chunk's
prompts in one call before they reach the engine), all submitted at once with
``max_num_seqs`` (default 256) running together:

- ``generate``: ``max_tokens=1``, greedy;
- ``classify``: three labels (``"yes"``, ``"no"``, ``"maybe"``, each scored with EOS).

Each step's device work is timed with ``perf_counter`` around the model's forward, its
``compute_logits``, the sampler's ``sample_tokens`` and the ``log_softmax`` of scored rows (on a
CPU these run synchronously, so the time is theirs; on a GPU they would be kernels launched
asynchronously). ``host`` is the rest of the wall time: scheduling, building step inputs, the
block pool, making outputs, the Python around each call. Printed per kind: jobs/s, and µs per job
of wall, device work and host; the median of ``--repeat`` runs (default 3), after one warm-up run.
``--gc-freeze`` first freezes the heap as the worker's engine core process does
(:func:`weir.engine.core.freeze_gc_heap`); without it the process's cyclic garbage collector walks
every object of torch and transformers at each full collection, as in a caller's own process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Optional


class DeviceTimer:
    """Adds the time spent in the wrapped callables to :attr:`seconds`."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


@contextlib.contextmanager
def timed_device_work(llm, timer: DeviceTimer):
    """Route the model's forward, ``compute_logits``, ``sample_tokens`` and ``log_softmax`` of the
    model runner through ``timer`` while the block runs."""
    import torch

    from weir.engine import model_runner

    runner = llm.llm_engine.runner
    model = runner.model
    saved = (model.forward, model.compute_logits, model_runner.sample_tokens, model_runner.torch)
    model.forward = timer.wrap(model.forward)
    model.compute_logits = timer.wrap(model.compute_logits)
    model_runner.sample_tokens = timer.wrap(model_runner.sample_tokens)

    class Torch:  # torch, with log_softmax timed (the model runner calls torch.log_softmax)
        def __getattr__(self, name):
            return getattr(torch, name)

        log_softmax = staticmethod(timer.wrap(torch.log_softmax))

    model_runner.torch = Torch()
    try:
        yield
    finally:
        model.forward, model.compute_logits, model_runner.sample_tokens, model_runner.torch = saved


def run(llm, kind: str, prompts: list[list[int]]) -> tuple[float, float]:
    """(wall seconds, device seconds) of one pass of ``kind`` over ``prompts``."""
    from weir.engine import SamplingParams

    timer = DeviceTimer()
    with timed_device_work(llm, timer):
        started = time.perf_counter()
        if kind == "generate":
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        else:
            outs = llm.classify(prompts, ["yes", "no", "maybe"])
            assert all(o.label in ("yes", "no", "maybe") for o in outs)
        wall = time.perf_counter() - started
    assert len(outs) == len(prompts)
    return wall, timer.seconds


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gc-freeze", action="store_true",
                        help="freeze the heap once the engine is built, as the engine core process does")
    args = parser.parse_args(argv)

    from weir.engine import LLM
    from weir.jobs.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="weir-host-cost-"), "tiny-chat-llama"))
    llm = LLM(model_dir, device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(2048, 24 * args.max_num_seqs))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(8 + i % 16)] for i in range(args.jobs)]
    if args.gc_freeze:
        from weir.engine.core import freeze_gc_heap

        freeze_gc_heap()
    print(f"{args.jobs} jobs per run, max_num_seqs {args.max_num_seqs}, torch threads "
          f"{__import__('torch').get_num_threads()}, heap {'frozen' if args.gc_freeze else 'not frozen'}; "
          f"medians of {args.repeat} runs")
    print(f"{'kind':<9} {'jobs/s':>8} {'wall µs/job':>12} {'device µs/job':>14} {'host µs/job':>12}")
    for kind in ("generate", "classify"):
        run(llm, kind, prompts[: args.max_num_seqs])  # warm-up
        results = [run(llm, kind, prompts) for _ in range(args.repeat)]
        wall = statistics.median(w for w, _ in results)
        device = statistics.median(d for _, d in results)
        host = statistics.median(w - d for w, d in results)
        n = args.jobs
        print(f"{kind:<9} {n / wall:>8.0f} {wall / n * 1e6:>12.1f} {device / n * 1e6:>14.1f} {host / n * 1e6:>12.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
