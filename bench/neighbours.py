"""The offline engine sharing the host with busy processes, against its quiet speed.

    python -m bench.neighbours                     # 2 busy neighbours, 3 runs per setting
    python -m bench.neighbours --neighbours 1 --repeat 1

The ``offline`` system of :mod:`bench.feeder` (the packaged SmolLM2-135M-Instruct, 64 W-gen
prompts, 48 tokens greedy, ``max_num_seqs`` 32, a fresh process per run, timed around one
``generate``), run quiet and then beside ``--neighbours`` busy processes (each a pure-Python
loop that never sleeps, started before the engine's process and killed after it), once per
setting of the engine's intra-op threads:

- ``default``: the engine's defaults (one intra-op thread per CPU; ``GOMP_SPINCOUNT`` of
  :mod:`weir.engine.openmp`: a thread that reaches a barrier first spins that long before it sleeps);
- ``openmp``: OpenMP's own spin (``GOMP_SPINCOUNT=300000``, what torch runs with outside weir);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once, giving its CPU back);
- ``1 thread``: ``OMP_NUM_THREADS=1``;
- any ``NAME=VALUE`` given in ``--settings``: that environment variable (e.g. ``GOMP_SPINCOUNT=10000``:
  how long GNU OpenMP's waiting threads spin before they sleep; its default is 300,000 spins).

A fair share of the host is the engine's quiet speed times ``cores / (cores + neighbours)``: half
of it for 2 cores and 2 neighbours (the engine's own busy threads count as one process). Printed
per setting: the medians of quiet and busy tokens/s, busy over quiet, and busy over the fair share
of the default's quiet speed (target >= 0.8). Texts are compared with the first quiet run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from typing import Optional

from bench.feeder import run_offline

SETTINGS = {"default": {}, "openmp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "1 thread": {"OMP_NUM_THREADS": "1"}}
BUSY_LOOP = "while True: pass"


def run(args: argparse.Namespace) -> int:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    results: dict[tuple[str, bool], list[dict]] = {}
    reference = None
    for i in range(args.repeat):
        for name in args.settings.split(","):
            env = {**base, **(SETTINGS[name] if name in SETTINGS else dict([name.split("=", 1)]))}
            for busy in (False, True):
                neighbours = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.neighbours if busy else 0)]
                try:
                    r = run_offline(args, env)
                finally:
                    for p in neighbours:
                        p.kill()
                        p.wait()
                r["tok_s"] = r["tokens"] / r["elapsed_s"]
                reference = reference or r["texts"]
                r["same"] = r["texts"] == reference
                results.setdefault((name, busy), []).append(r)
                print(f"run {i + 1} {name:20s} {'busy' if busy else 'quiet':5s} {r['tokens']:5d} tokens in "
                      f"{r['elapsed_s']:6.2f} s: {r['tok_s']:7.1f} tok/s", flush=True)
    cores = os.cpu_count() or 1
    share = cores / (cores + args.neighbours)
    median = {key: statistics.median(r["tok_s"] for r in rs) for key, rs in results.items()}
    fair = median[("default", False)] * share if ("default", False) in median else None
    print(f"\n{args.neighbours} busy neighbours on {cores} CPUs (a fair share: {share:.2f} of the quiet speed); "
          f"medians of {args.repeat} runs")
    for name in args.settings.split(","):
        quiet, busy = median[(name, False)], median[(name, True)]
        line = f"{name:20s} quiet {quiet:7.1f}  busy {busy:7.1f} tok/s  busy/quiet {busy / quiet:.2f}"
        if fair:
            line += f"  busy/fair share {busy / fair:.2f} (target >= 0.8)"
        same = all(r["same"] for key, rs in results.items() if key[0] == name for r in rs)
        print(line + f"  texts equal: {same}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated: default, openmp, passive, 1 thread, or NAME=VALUE environment settings")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
