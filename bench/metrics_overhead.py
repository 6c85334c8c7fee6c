"""What the worker's Prometheus metrics cost the engine: generation throughput with the engine's
stat logger attached (metrics on) against none (off), in one process.

Usage::

    python -m bench.metrics_overhead [--model PATH | --tiny] [--prompts 32] [--max-tokens 32] [--rounds 5]

One ``LLM`` (the packaged SmolLM2 unless told otherwise; ``--tiny``: a random 2-layer Llama, whose
steps are so short that the per-step cost weighs most), one torch thread. Each round runs the same
batch (``--prompts`` distinct prompts of about 40 tokens, greedy, ``--max-tokens`` tokens each,
EOS ignored, prefix cache emptied first) once with metrics off and once on, the order alternating
round by round; the figures are medians over the rounds of generated tokens per second of wall
time and per second of the engine thread's CPU time (``time.thread_time``: on a machine shared
with other work the wall clock also counts the time others took the core), and each ratio also as
the median of the rounds' on/off pairs (two runs side by side share the machine's load better
than two medians do). Metrics on is what ``weir worker`` does with ``WEIR_METRICS_PORT`` set: a
:class:`weir.worker.metrics.PrometheusStatLogger` in ``engine.stat_loggers``; the periodic stats
line reads ``stats()`` snapshots from another thread and costs the step loop nothing.

On a machine shared with other work the rounds vary by more than the 2 % looked for, so the
metrics' own time is also measured where it is spent: in the "on" rounds the engine's
``_record_stats`` (building the stats and every logger's ``record``) is timed inside the step
loop, and its sum is given as a share of those rounds' wall time. And one ``record`` call with a
step's typical stats is timed alone (µs, median of batches).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _llm(args):
    from weir.engine import LLM

    common = dict(max_num_seqs=args.prompts, num_gpu_blocks_override=args.num_blocks, device="cpu")
    if args.tiny:
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             eos_token_id=2)
        return LLM(config, load_format="dummy", **common)
    return LLM(args.model, **common)


def _round(llm, prompts, params) -> tuple[float, float, int]:
    """Tokens per wall second and per CPU second of this thread for one batch, and its engine steps."""
    llm.reset_prefix_cache()
    steps_before = llm.stats()["num_steps_eager"]
    start, start_cpu = time.perf_counter(), time.thread_time()
    outs = llm.generate(prompts, params)
    elapsed_s, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
    num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return num_tokens / elapsed_s, num_tokens / cpu_s, llm.stats()["num_steps_eager"] - steps_before


def _record_us(stat_logger, num_finished: int, repeats: int = 20, calls: int = 2000) -> float:
    """Median µs of one ``record`` with typical deltas and ``num_finished`` finished requests."""
    from weir.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats

    sched = SchedulerStats(32, 4, 0.4)
    per_call = []
    for _ in range(repeats):
        its = [IterationStats(40, 32, 0, 40, 32, [FinishedRequestStats(0.01, 0.2, 1.5)] * num_finished)
               for _ in range(calls)]
        start = time.perf_counter()
        for it in its:
            stat_logger.record(sched, it)
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: packaged SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer Llama instead")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (16 tokens each)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from weir.engine import SamplingParams
    from weir.worker.metrics import PrometheusStatLogger, WorkerMetrics

    llm = _llm(args)
    engine = llm.llm_engine
    vocab = engine.config.vocab_size
    # distinct prompts of 38-45 tokens: every round computes every prompt
    prompts = [[(7 + 13 * i + 31 * j) % (vocab - 3) + 3 for j in range(38 + i % 8)] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    stat_logger = PrometheusStatLogger(WorkerMetrics(), llm.model_name)
    record_stats = engine._record_stats
    in_record_s = [0.0]

    def timed_record_stats() -> None:
        start = time.perf_counter()
        record_stats()
        in_record_s[0] += time.perf_counter() - start

    engine._record_stats = timed_record_stats
    _round(llm, prompts[:4], params)  # warm-up: kernel build, allocator

    wall: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    steps, on_wall_s = 0, 0.0
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            engine.stat_loggers[:] = [stat_logger] if mode == "on" else []
            tokens_per_s, tokens_per_cpu_s, steps = _round(llm, prompts, params)
            if mode == "on":
                on_wall_s += args.prompts * args.max_tokens / tokens_per_s
            wall[mode].append(tokens_per_s)
            cpu[mode].append(tokens_per_cpu_s)
    engine.stat_loggers.clear()

    print(f"model {llm.model_name}, {args.prompts} prompts x {args.max_tokens} tokens, {steps} steps a round, "
          f"{args.rounds} rounds, 1 torch thread")
    for what, figures in (("tokens/s", wall), ("tokens/CPU-s", cpu)):
        off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
        paired = statistics.median(a / b for a, b in zip(figures["on"], figures["off"]))
        print(f"{what:>12}: off {off:9.1f}, on {on:9.1f}; on / off {100 * on / off:.1f} % (medians), "
              f"{100 * paired:.1f} % (median of the rounds' pairs)")
        print(f"{'':>12}  rounds off: {', '.join(f'{v:.0f}' for v in figures['off'])}")
        print(f"{'':>12}  rounds on:  {', '.join(f'{v:.0f}' for v in figures['on'])}")
    print(f"in the engine, metrics took {1e3 * in_record_s[0]:.1f} ms of the 'on' rounds' {on_wall_s:.2f} s: "
          f"{100 * in_record_s[0] / on_wall_s:.3f} % (so on / off = {100 * (1 - in_record_s[0] / on_wall_s):.2f} %)")
    record_us = _record_us(stat_logger, 0)
    record_finished_us = _record_us(stat_logger, 1)
    step_ms = 1e3 * args.prompts * args.max_tokens / statistics.median(cpu["off"]) / steps
    print(f"record(): {record_us:.2f} us a step, {record_finished_us:.2f} us with one finished request; "
          f"a step takes {step_ms:.2f} ms of CPU: {100 * record_us / (1e3 * step_ms):.3f} % of it")


if __name__ == "__main__":
    main()
