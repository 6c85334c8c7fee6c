"""The engine fed as a queue feeds it: the same prompts arriving one every few milliseconds into a
running engine, against all of them at once.

    python -m bench.stream                           # SmolLM2, 64 W-gen prompts, max_num_seqs 8 and 32
    python -m bench.stream --tiny --prompts 16 --max-tokens 8 --repeat 1   # smoke: the tiny model

The offline engine (:class:`weir.engine.LLM`, its ``LLMEngine`` stepped directly) on the packaged
SmolLM2-135M-Instruct (``--tiny``: :func:`weir.jobs.testing.save_tiny_chat_model`, random
weights), ``--prompts`` W-gen prompts (chat messages, encoded before timing), ``--max-tokens``
greedy. One engine per ``max_num_seqs``; before each run its prefix cache is reset, so every run
computes the same prompts from scratch. Systems, alternating, ``--repeat`` runs each:

- ``at once``: every request added, then the engine stepped until all finished (what
  ``LLM.generate`` does);
- ``stream``: request ``i`` added at ``i * --arrive-every-ms`` after the start, between steps of the
  running engine (an idle engine sleeps until the next arrival), as a worker's queue delivers them.

Metric: generated tokens per second, from the start (the first request added) to the last output.
Printed per run, then per ``max_num_seqs`` the medians and stream over at once (target >= 0.8),
and whether the stream's texts equal the at-once texts (greedy: they must).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Optional


def run_once(llm, prompt_ids: list[list[int]], params, arrive_every_s: Optional[float]) -> tuple[float, list]:
    """(seconds, outputs in prompt order) of one run; ``arrive_every_s`` None: all at once."""
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    n = len(prompt_ids)
    outputs = {}
    started = time.perf_counter()
    num_added = 0
    while len(outputs) < n:
        now = time.perf_counter()
        while num_added < n and (arrive_every_s is None or started + num_added * arrive_every_s <= now):
            engine.add_request(prompt_ids[num_added], params, request_id=f"r{num_added}")
            num_added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, started + num_added * arrive_every_s - time.perf_counter()))
            continue
        for out in engine.step():
            outputs[out.request_id] = out
    elapsed = time.perf_counter() - started
    return elapsed, [outputs[f"r{i}"] for i in range(n)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", default="8,32", help="comma-separated; one engine each")
    ap.add_argument("--arrive-every-ms", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the random-weight tiny chat model instead of SmolLM2")
    args = ap.parse_args(argv)

    from bench.workloads import w_gen_messages
    from weir.engine import LLM, SamplingParams

    model = None
    if args.tiny:
        from weir.jobs.testing import save_tiny_chat_model

        model = save_tiny_chat_model(os.path.join(tempfile.mkdtemp(prefix="weir-stream-"), "tiny-chat-llama"))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    gap_s = args.arrive_every_ms / 1e3
    print(f"{args.prompts} W-gen prompts, max_tokens {args.max_tokens} greedy, one every {args.arrive_every_ms:g} ms "
          f"in the stream, model {'tiny (random weights)' if args.tiny else 'SmolLM2-135M-Instruct'}", flush=True)
    verdicts = []
    for max_num_seqs in map(int, args.max_num_seqs.split(",")):
        llm = LLM(model, max_num_seqs=max_num_seqs)
        prompt_ids = [llm.encode_prompt(m) for m in w_gen_messages(args.prompts)]
        run_once(llm, prompt_ids[:4], params, None)  # warm-up
        rates: dict[str, list[float]] = {"at once": [], "stream": []}
        texts: dict[str, list] = {}
        for i in range(args.repeat):
            for system, gap in (("at once", None), ("stream", gap_s)):
                elapsed, outs = run_once(llm, prompt_ids, params, gap)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[system].append(tokens / elapsed)
                texts.setdefault(system, [o.outputs[0].text for o in outs])
                print(f"max_num_seqs {max_num_seqs:3d} run {i + 1} {system:8s} {tokens:5d} tokens in {elapsed:6.2f} s: "
                      f"{tokens / elapsed:7.1f} tok/s", flush=True)
        at_once, stream = (statistics.median(rates[s]) for s in ("at once", "stream"))
        same = texts["stream"] == texts["at once"]
        verdicts.append(same)
        print(f"max_num_seqs {max_num_seqs}: stream {stream:.1f} / at once {at_once:.1f} tok/s = {stream / at_once:.2f} "
              f"(target >= 0.8); texts equal: {same}", flush=True)
        del llm
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
