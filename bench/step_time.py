"""Wall time of one decode step by batch size, and what it makes an interactive request cost a bulk batch.

    python -m bench.step_time                          # the tiny model of bench.priority, 1-64 sequences
    python -m bench.step_time --batch-sizes 1,8,32,64 --tokens 16 --repeat 5 --model PATH

The offline ``LLM`` (torch's default intra-op threads, as the worker's engine core on a host of up
to two CPUs, and the engine's ``GOMP_SPINCOUNT``, :mod:`weir.engine.openmp`, unless the environment
sets one: ``GOMP_SPINCOUNT=300000 python -m bench.step_time`` for OpenMP's own) with
``max_num_seqs`` the largest batch size, on
:func:`weir.jobs.testing.save_tiny_chat_model` unless ``--model`` names another. For each batch
size ``k``: ``k`` prompts generated greedily to ``--tokens`` tokens (``ignore_eos``) and to one
token, all at once; a decode step is ``(T(tokens) - T(1)) / (tokens - 1)`` (the prefill cancels
out), the median of ``--repeat`` runs after a warm-up. Printed: ms per step, ms per token.

Then, from those figures, for ``bench.priority``'s shape (``--probes`` interactive requests of
``--tokens`` tokens while a bulk batch of the largest batch size decodes):

- ``strict``: each probe runs alone while the bulk requests wait: the bulk batch loses the probe's
  whole time, ``tokens x t(1)`` per probe;
- ``sharing j``: each probe step also decodes ``j`` bulk requests: the step takes ``t(j + 1)``, of
  which ``j x t(K) / K`` is bulk work done at the full batch's rate, so the bulk batch loses
  ``tokens x (t(j + 1) - j x t(K) / K)`` per probe while the probe takes ``t(j + 1) / t(1)`` times
  as long in the engine.

The interpolation between measured batch sizes is linear; nothing outside the engine is counted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def step_ms(llm, batch: int, tokens: int, repeat: int) -> float:
    """Median wall ms of one decode step of ``batch`` sequences (see the module's docstring)."""
    from weir.engine import SamplingParams

    prompts = [f"Product {i}: describe it." for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    run(tokens)
    return statistics.median((run(tokens) - run(1)) / (tokens - 1) * 1000 for _ in range(repeat))


def interpolate(points: dict[int, float], k: int) -> float:
    """``points`` (batch size -> ms) at ``k``, linear between the nearest measured sizes."""
    sizes = sorted(points)
    if k <= sizes[0]:
        return points[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if k <= hi:
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    return points[sizes[-1]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: the random-weight tiny chat model)")
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (bench.priority's max_tokens)")
    ap.add_argument("--probes", type=int, default=30, help="interactive requests (bench.priority's --probes)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    try:
        sizes = sorted({int(s) for s in args.batch_sizes.split(",")})
    except ValueError:
        ap.error(f"--batch-sizes must be whole numbers separated by commas, got {args.batch_sizes!r}")
    if sizes[0] != 1:
        ap.error("--batch-sizes must include 1 and no size below it")
    if args.repeat < 1 or args.probes < 0:
        ap.error("--repeat must be at least 1 and --probes at least 0")

    from weir.engine import LLM
    from weir.jobs.testing import save_tiny_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or save_tiny_chat_model(tmp)
        llm = LLM(model=model, max_num_seqs=sizes[-1])
        points = {k: step_ms(llm, k, args.tokens, args.repeat) for k in sizes}
    full = sizes[-1]
    print(f"decode step, median of {args.repeat} ({args.tokens} tokens each)")
    print(f"{'sequences':>9} {'ms/step':>8} {'ms/token':>9}")
    for k in sizes:
        print(f"{k:9d} {points[k]:8.2f} {points[k] / k:9.3f}")
    rate = points[full] / full
    print(f"\n{args.probes} probes of {args.tokens} tokens beside a bulk batch of {full} sequences:")
    print(f"{'mode':>12} {'probe engine ms':>16} {'x alone':>8} {'bulk loses s':>13}")
    for j in [0] + [k for k in sizes if 0 < k < full]:
        step = interpolate(points, j + 1)
        lost = args.probes * args.tokens * (step - j * rate) / 1000
        print(f"{'strict' if j == 0 else f'sharing {j}':>12} {args.tokens * step:16.1f} "
              f"{step / points[1]:8.2f} {lost:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
