"""Host time of one engine step without the model: schedule, build the step inputs, update.

Usage::

    python -m bench.host_step [--batch 256] [--contexts 400,2000] [--steps 60] [--before 95ed8dc]

The real ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` (block size 16, prefix caching on) run
``--batch`` requests whose prompts of ``context`` to ``context + 15`` random tokens (request ``i``
has ``i % 16`` extra, so rows gain blocks at different steps) were prefilled before timing starts;
a stub stands in for the forward pass and samples token 7 for every request. Two steps are timed:

- ``decode``: every running request decodes one token (the ``--batch`` rows of a decode step).
- ``mixed``: the same decodes plus a 256-token chunk of a ``context``-token prompt (one prompt at a
  time, chunked over several steps, each finishing once its prompt is done).

Each step's parts are timed with ``perf_counter``: ``schedule()``; building the step inputs on the
CPU device with int32 indices (the Triton backend's dtype), the persistent ``InputBatch`` when the
revision has one (``engine/input_batch.py``), the list-based builder otherwise; ``update()`` plus
freeing the finished requests. Figures are medians over the timed steps, in ms.

"before" is the engine at ``--before``, exported with ``git archive`` and imported in a subprocess
as ``weir``; "after" is this working tree, in another subprocess; the two alternate ``--repeats``
times and each figure is the median of the repeats' medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("schedule", "build", "update", "total")
FOLDERS = ("engine", "kernels", "worker", "jobs", "migrations")
BLOCK_SIZE = 16
CHUNK = 256


def _shim(tree: str) -> str:
    """A folder where ``import weir`` finds the folders of ``tree`` (the setuptools mapping, by
    symlinks)."""
    shim = tempfile.mkdtemp(prefix="weir-shim-")
    pkg = os.path.join(shim, "weir")
    os.mkdir(pkg)
    os.symlink(os.path.join(tree, "weir", "__init__.py"), os.path.join(pkg, "__init__.py"))
    for name in FOLDERS:
        os.symlink(os.path.join(tree, name), os.path.join(pkg, name))
    return shim


def _measure(batch: int, context: int, steps: int, warmup: int, mixed: bool) -> dict[str, float]:
    """Median ms per part over ``steps`` timed steps (after ``warmup`` untimed ones)."""
    import random

    import torch

    from weir.engine.block_pool import BlockPool
    from weir.engine.kv_cache_manager import KVCacheManager
    from weir.engine.request import Request
    from weir.engine.sampling_params import SamplingParams
    from weir.engine.scheduler import ModelRunnerOutput, Scheduler
    from weir.engine.step_inputs import build_step_inputs

    try:
        from weir.engine.input_batch import InputBatch
    except ImportError:
        InputBatch = None

    num_steps = steps + warmup
    max_model_len = context + num_steps + 3 * BLOCK_SIZE
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    kv = KVCacheManager(BlockPool(blocks_per_req * (batch + 2)), BLOCK_SIZE, lambda src, dst: None)
    sched_ = Scheduler(kv, batch + 1 if mixed else batch, batch * (context + BLOCK_SIZE), max_model_len)
    rng = random.Random(0)

    def prompt(i: int = 0) -> list[int]:  # i % 16 more tokens: rows cross block boundaries at different steps
        return [rng.randrange(3, 32000) for _ in range(context + i % BLOCK_SIZE)]

    decode_params = SamplingParams(temperature=0, max_tokens=num_steps + 2, ignore_eos=True)
    for i in range(batch):
        sched_.add_request(Request(f"r{i}", prompt(i), decode_params))
    s = sched_.schedule()  # every prompt prefilled in one untimed step
    sched_.update(s, ModelRunnerOutput(sampled={x.request.request_id: 7 for x in s.scheduled}))
    sched_.max_num_batched_tokens = batch + CHUNK if mixed else batch
    batch_rows = InputBatch(batch + 1, blocks_per_req, torch.device("cpu")) if InputBatch else None
    chunked_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = {p: [] for p in PARTS}
    copies: list[tuple[int, int]] = []  # per step: (rows changed, rows in their span)
    if batch_rows is not None:
        table, commit = batch_rows.block_table, batch_rows.block_table.commit

        def counted_commit():
            rows = table.changed_rows
            copies.append((len(rows), rows[-1] - rows[0] + 1 if rows else 0))
            commit()

        table.commit = counted_commit
    for step in range(num_steps):
        if mixed and not sched_.waiting and len(sched_.running) == batch:
            sched_.add_request(Request(f"p{step}", prompt(), chunked_params))
        t0 = time.perf_counter()
        s = sched_.schedule()
        t1 = time.perf_counter()
        if batch_rows is not None:
            inputs = build_step_inputs(s, BLOCK_SIZE, torch.device("cpu"), torch.int32, input_batch=batch_rows)
        else:
            inputs = build_step_inputs(s, BLOCK_SIZE, torch.device("cpu"), torch.int32)
        t2 = time.perf_counter()
        result = ModelRunnerOutput(sampled={x.request.request_id: 7 for x in inputs.requests if x.completes_prompt})
        t3 = time.perf_counter()
        update = sched_.update(s, result)
        sched_.free(update.finished)
        t4 = time.perf_counter()
        assert len(s.scheduled) == batch + (1 if mixed else 0), "the step lost a request"
        if step >= warmup:
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t4 - t3, (t2 - t0) + (t4 - t3))):
                times[part].append(dt * 1e3)
    out = {p: statistics.median(v) for p, v in times.items()}
    if copies:
        timed = copies[warmup:]
        out["rows_changed"] = statistics.mean(c for c, _ in timed)
        out["rows_spanned"] = statistics.mean(s for _, s in timed)
    return out


def _worker(args) -> None:
    import weir.engine

    assert os.path.realpath(weir.engine.__file__).startswith(os.path.realpath(args.tree)), weir.engine.__file__
    for context in args.contexts:
        for kind in ("decode", "mixed"):
            row = _measure(args.batch, context, args.steps, args.warmup, kind == "mixed")
            print(json.dumps({"context": context, "step": kind, **row}), flush=True)


def _export(rev: str) -> str:
    tree = tempfile.mkdtemp(prefix=f"weir-{rev}-")
    archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[400, 2000])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per scenario")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="alternating before/after runs")
    ap.add_argument("--before", default="95ed8dc", help="git revision of the 'before' engine")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # internal: run the timings on this tree
    args = ap.parse_args()
    if args.tree:
        _worker(args)
        return
    trees = {"before": _export(args.before), "after": REPO_ROOT}
    shims = {name: _shim(tree) for name, tree in trees.items()}
    site_dirs = [p for p in sys.path if "-packages" in p]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            # -S: no site hooks, so no editable install can map weir.* onto another tree
            cmd = [sys.executable, "-S", os.path.abspath(__file__), "--tree", tree, "--batch", str(args.batch),
                   "--contexts", ",".join(map(str, args.contexts)), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([shims[name], *site_dirs])}
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
            if done.returncode:
                sys.exit(f"{name} run failed:\n{done.stderr}")
            out = done.stdout
            runs[name].append({(r["context"], r["step"]): r for r in map(json.loads, out.splitlines())})
    print(f"host ms per step, batch {args.batch}, median of {args.steps} steps "
          f"(median of {args.repeats} alternating runs); before = {args.before}")
    print(f"{'context':>7} {'step':<6} " + " ".join(f"{p + ' b/a':>17}" for p in PARTS) + f" {'ratio':>6}")
    for key in runs["after"][0]:
        fig = {name: {p: statistics.median(run[key][p] for run in rs) for p in PARTS} for name, rs in runs.items()}
        cells = " ".join(f"{fig['before'][p]:>8.3f}/{fig['after'][p]:<8.3f}" for p in PARTS)
        print(f"{key[0]:>7} {key[1]:<6} {cells} {fig['before']['total'] / fig['after']['total']:>5.1f}x")
    print("after: block-table rows written per step (mean): changed / span from first to last changed")
    for key, row in runs["after"][0].items():
        if "rows_changed" in row:
            print(f"{key[0]:>7} {key[1]:<6} {row['rows_changed']:>6.1f} / {row['rows_spanned']:.1f}")


if __name__ == "__main__":
    main()
