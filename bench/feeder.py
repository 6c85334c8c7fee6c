"""The engine under a queue: the same real-model generations offline and through ``weir worker``.

    python -m bench.feeder                  # 64 W-gen prompts, 48 tokens greedy, max_num_seqs 32
    python -m bench.feeder --repeat 3 --systems offline,worker
    python -m bench.feeder --systems offline,worker --worker-env WEIR_CPU_NUM_OF_RESERVED_CPU=1

Systems, each in a fresh process, on the packaged SmolLM2-135M-Instruct, same engine settings
(``max_num_seqs``, the default KV cache, torch's default intra-op threads):

- ``offline``: ``LLM.generate`` on all prompts at once (the model loaded and warmed first);
- ``worker``: ``python -m weir worker`` with its defaults (the engine core in a process of its
  own), ``WEIR_CONCURRENCY = WEIR_MAX_NUM_SEQS``; the prompts enqueued as one batch through
  :meth:`weir.jobs.client.Client.enqueue_batch` once the worker has run a warm-up batch;
- ``worker-thread``: the same with ``WEIR_ENGINE_MULTIPROCESSING=false`` (the step loop on a
  thread of the worker's process, as before the engine core process).

Metric: generated tokens (what each system returned) per second, from the first publish (offline:
the ``generate`` call) to the last result stored (the latest ``finished_at``). Printed per run,
then the medians and each worker's ratio to offline (target >= 0.9), and whether every system's
texts equal offline's. Needs Redis and PostgreSQL as ``bench.pipeline`` does.
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
import uuid
from datetime import datetime, timezone
from typing import Optional

from weir.worker.testing import WorkerProcess, delete_queue_keys, service_urls, worker_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()


def prompts(n: int) -> list:
    from bench.workloads import w_gen_messages

    return w_gen_messages(n)


def offline_main(n: int, max_tokens: int, max_num_seqs: int) -> None:
    """Run in a fresh process: load, warm up, time one ``generate``; print one JSON line."""
    from weir import LLM, SamplingParams

    llm = LLM(max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    batch = prompts(n)
    llm.generate(batch[:4], params)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    texts = [o.outputs[0].text for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"elapsed_s": elapsed, "tokens": tokens, "texts": texts}))


def run_offline(args, env: Optional[dict] = None) -> dict:
    """One ``offline`` run in a fresh process (``env``: its environment, default this one's)."""
    out = subprocess.run([sys.executable, "-m", "bench.feeder", "--offline-child", str(args.prompts),
                          str(args.max_tokens), str(args.max_num_seqs)],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_worker(args, workdir: str, multiprocessing: bool) -> dict:
    import redis
    from sqlalchemy import func, select

    from weir import migrations
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client
    from weir.jobs.db import Job
    from weir.jobs.schemas import GenerateRequest
    from weir.jobs.testing import temporary_postgres_database
    from weir.model_source import default_model_path

    model = default_model_path()
    queue = f"weir.bench-feeder-{uuid.uuid4().hex[:8]}"
    with temporary_postgres_database(POSTGRES_ADMIN_URL, prefix="weir_feeder_") as database_url:
        migrations.upgrade(database_url)
        env = worker_env(broker_url=args.redis_url, queue=queue, database_url=database_url, model=model,
                         concurrency=args.max_num_seqs, python_path=[REPO_ROOT],
                         WEIR_ENGINE_MULTIPROCESSING=str(multiprocessing).lower())
        for name in ("OMP_NUM_THREADS", "WEIR_CPU_KV_CACHE_BYTES"):  # the engine's defaults, as offline
            env.pop(name, None)
        if args.omp_num_threads:
            env["OMP_NUM_THREADS"] = str(args.omp_num_threads)
        env.update(item.split("=", 1) for item in args.worker_env)
        client = Client(Settings(engine=EngineSettings(model=model),
                                 worker=WorkerSettings(broker_url=args.redis_url, queue=queue),
                                 database=DatabaseSettings(database_url=database_url)))
        label = "process" if multiprocessing else "thread"
        worker = WorkerProcess(env, os.path.join(workdir, f"worker-{label}-{uuid.uuid4().hex[:6]}.log"), cwd=REPO_ROOT)
        try:
            worker.wait_ready()
            batch = prompts(args.prompts)
            requests = [GenerateRequest(prompt=p, temperature=0, max_tokens=args.max_tokens) for p in batch]
            client.wait(client.enqueue_batch(requests[:4]), timeout_s=600)  # warm-up
            started = datetime.now(timezone.utc)
            batch_id = client.enqueue_batch(requests)
            client.wait(batch_id, timeout_s=1800, poll_interval_s=0.1)
            with client.session_factory() as session:
                last = session.scalar(select(func.max(Job.finished_at)).where(Job.batch_id == batch_id))
            rows = list(client.results(batch_id))
        finally:
            worker.kill()
            client.close()
            delete_queue_keys(redis.Redis.from_url(args.redis_url), queue)
    failed = [r for r in rows if r["status"] != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs did not succeed: {failed[0]['error']}")
    return {"elapsed_s": (last - started).total_seconds(), "tokens": sum(r["num_completion_tokens"] for r in rows),
            "texts": [r["output_text"] for r in rows]}


def run(args: argparse.Namespace) -> int:
    systems = args.systems.split(",")
    workdir = tempfile.mkdtemp(prefix="weir-feeder-")
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for i in range(args.repeat):
        for system in systems:  # alternating, so drift in the machine's load hits every system
            if system == "offline":
                r = run_offline(args)
            elif system in ("worker", "worker-thread"):
                r = run_worker(args, workdir, multiprocessing=system == "worker")
            else:
                raise SystemExit(f"unknown system {system!r}")
            r["tok_s"] = r["tokens"] / r["elapsed_s"]
            results[system].append(r)
            print(f"run {i + 1} {system:14s} {r['tokens']:5d} tokens in {r['elapsed_s']:6.2f} s: "
                  f"{r['tok_s']:7.1f} tok/s", flush=True)
    print(f"\n{args.prompts} W-gen prompts, max_tokens {args.max_tokens} greedy, max_num_seqs {args.max_num_seqs}, "
          f"{args.repeat} runs, medians (logs in {workdir})")
    medians = {s: statistics.median(r["tok_s"] for r in rs) for s, rs in results.items()}
    reference = results.get("offline", [None])[0]
    for system, rs in results.items():
        line = f"{system:14s} {medians[system]:7.1f} tok/s"
        if "offline" in medians and system != "offline":
            line += f"  {medians[system] / medians['offline']:.2f}x offline (target >= 0.9)"
        if reference is not None:
            line += f"  texts equal offline's: {all(r['texts'] == reference['texts'] for r in rs)}"
        print(line)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--offline-child":
        offline_main(*map(int, argv[1:4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--systems", default="offline,worker,worker-thread")
    ap.add_argument("--omp-num-threads", type=int, default=0, help="OMP_NUM_THREADS of the workers (0: unset)")
    ap.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                    help="one more variable of the workers' environment (repeatable)")
    ap.add_argument("--redis-url", default=REDIS_URL)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
