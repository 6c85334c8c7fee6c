"""Interactive latency while a nightly bulk batch runs, against idle, through a real ``weir worker``.

    python -m bench.priority                       # 2,000 bulk jobs, 30 interactive probes each phase
    python -m bench.priority --bulk 500 --probes 10

One worker (Redis, a fresh PostgreSQL database, a private queue; the random-weight tiny chat model
of :func:`weir.jobs.testing.save_tiny_chat_model`, so it measures scheduling, not inference) with
``WEIR_SCHEDULING_POLICY=priority``. A probe is one job enqueued through the client on its own
(``Client.enqueue_generate``, priority 0), the next sent when the last finished; its latency is
its batch's ``finished_at - created_at`` from the database (enqueue to stored result). Phases, in
one run:

- ``idle``: probes with nothing else queued;
- ``bulk, priority``: probes while a ``--bulk``-job batch enqueued at the catalog job's priority
  (:data:`weir.jobs.schemas.BULK_PRIORITY`, 9) runs;
- ``bulk, no priority`` (``--fcfs-baseline``): the same with the bulk batch at priority 0, what
  every job got before priorities (the probes queue behind the backlog);
- ``strict idle`` and ``strict bulk, priority``: the same again on a second worker with
  ``WEIR_STRICT_PRIORITY=true`` (bulk requests are held while an interactive one runs).

Printed: p50 and p99 per phase (p99 of 30 probes is their maximum but one, interpolated) and the
ratio to the same worker's idle phase; the target is p99 under bulk load at most 2x idle, the bulk
batch taking at most 10 % longer than the same batch without probes (run just before; both timed
``finished_at - created_at`` from the database). Then the median of each stage
(ms): ``claim`` (batch created to the job claimed by the worker: Redis, a task thread, the claim
transaction), ``run`` (claimed to the job's result stored: the engine and the result write),
``close`` (the result stored to the batch finished).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from typing import Optional

from weir.worker.testing import WorkerProcess, delete_queue_keys, service_urls, worker_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def probe_latencies(client, num: int, max_tokens: int, busy=None, stages: Optional[list] = None) -> list[float]:
    """Latencies (s) of ``num`` interactive jobs sent one after another (while ``busy()`` is true,
    when given: the probes stop early when the bulk batch ends). ``stages``, when given, gets one
    ``(created -> claimed, claimed -> job stored, job stored -> batch finished)`` tuple (s) per probe."""
    from sqlalchemy import select

    from weir.jobs.db import Batch, Job

    out = []
    for i in range(num):
        if busy is not None and not busy():
            break
        ref = client.enqueue_generate(f"Interactive question {i}: say hello.", temperature=0, max_tokens=max_tokens)
        client.wait(ref.batch_id, timeout_s=600)  # woken by the batch channel as the probe finishes
        with client.session_factory() as session:
            batch = session.get(Batch, ref.batch_id)
            out.append((batch.finished_at - batch.created_at).total_seconds())
            if stages is not None:
                job = session.scalars(select(Job).where(Job.batch_id == ref.batch_id)).one()
                stages.append(tuple(t.total_seconds() for t in (
                    job.claimed_at - batch.created_at, job.finished_at - job.claimed_at,
                    batch.finished_at - job.finished_at)))
    return out


def batch_seconds(client, batch_id) -> float:
    """A finished batch's ``finished_at - created_at`` from the database (s): the batch's own time,
    not the client's polls for it (``Client.wait`` polls every 0.5 s)."""
    from weir.jobs.db import Batch

    with client.session_factory() as session:
        batch = session.get(Batch, uuid.UUID(str(batch_id)))
        return (batch.finished_at - batch.created_at).total_seconds()


def run(args: argparse.Namespace) -> int:
    from weir.jobs.schemas import BULK_PRIORITY
    from weir.jobs.testing import save_tiny_chat_model

    workdir = tempfile.mkdtemp(prefix="weir-priority-")
    model_dir = save_tiny_chat_model(os.path.join(workdir, "tiny-chat-llama"))
    # one worker per engine mode, in turn: (label, its settings beyond the defaults, bulk phases)
    modes = [("", {}, [("bulk, priority", BULK_PRIORITY)]
              + ([("bulk, no priority", 0)] if args.fcfs_baseline else [])),
             ("not strict ", {"WEIR_SCHEDULING_POLICY": "priority", "WEIR_STRICT_PRIORITY": "false"},
              [("bulk, priority", BULK_PRIORITY)]),
             ("fcfs ", {"WEIR_SCHEDULING_POLICY": "fcfs"}, [("bulk, priority", BULK_PRIORITY)])]
    wanted = args.modes.split(",")
    unknown = set(wanted) - {"default", "not-strict", "fcfs"}
    if unknown:
        raise SystemExit(f"--modes: unknown mode(s) {', '.join(sorted(unknown))} (default, not-strict, fcfs)")
    modes = [m for m in modes if (m[0].strip().replace(" ", "-") or "default") in wanted]
    runs = []
    for _ in range(args.repeat):
        runs.append(run_modes(args, modes, workdir, model_dir))
    for rows in runs:
        print_rows(args, rows)
    if len(runs) > 1:
        print_medians(runs)
    return 0


def run_modes(args: argparse.Namespace, modes: list, workdir: str, model_dir: str) -> list:
    """One run of each worker mode: ``(phase, latencies, stages, bulk)`` rows, ``bulk`` being
    ``(seconds with probes, still running after the last probe, seconds alone)`` or None (idle)."""
    import redis

    from weir import migrations
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client
    from weir.jobs.schemas import GenerateRequest
    from weir.jobs.testing import temporary_postgres_database

    rows = []
    for label, overrides, phases in modes:
        queue = f"weir.priority-{uuid.uuid4().hex[:8]}"
        with temporary_postgres_database(POSTGRES_ADMIN_URL, prefix="weir_priority_") as database_url:
            migrations.upgrade(database_url)
            env = worker_env(broker_url=args.redis_url, queue=queue, database_url=database_url, model=model_dir,
                             concurrency=args.concurrency or args.max_num_seqs, python_path=[REPO_ROOT],
                             WEIR_MAX_NUM_SEQS=args.max_num_seqs,
                             WEIR_MAX_NUM_BATCHED_TOKENS=args.max_num_batched_tokens, **overrides)
            for name in ("WEIR_SCHEDULING_POLICY", "WEIR_STRICT_PRIORITY", "WEIR_INTERACTIVE_CONCURRENCY"):
                if name not in overrides:
                    env.pop(name, None)  # the worker's defaults
            client = Client(Settings(engine=EngineSettings(model=model_dir),
                                     worker=WorkerSettings(broker_url=args.redis_url, queue=queue),
                                     database=DatabaseSettings(database_url=database_url)))
            worker = WorkerProcess(env, os.path.join(workdir, f"worker-{label.strip() or 'default'}.log"), cwd=REPO_ROOT)
            try:
                worker.wait_ready()
                probe_latencies(client, 3, args.max_tokens)  # warm-up: first compile, first connections
                stages = []
                rows.append((label + "idle", probe_latencies(client, args.probes, args.max_tokens, stages=stages),
                             stages, None))
                for name, priority in phases:
                    bulk = [GenerateRequest(prompt=f"Product {i}: describe it.", temperature=0,
                                            max_tokens=args.max_tokens) for i in range(args.bulk)]
                    alone_id = client.enqueue_batch(bulk, priority=priority)
                    client.wait(alone_id, timeout_s=3600)
                    alone_s = batch_seconds(client, alone_id)  # the same batch without probes
                    batch_id = client.enqueue_batch(bulk, priority=priority)
                    time.sleep(1.0)  # the worker's threads and engine fill with bulk jobs first
                    stages = []
                    latencies = probe_latencies(client, args.probes, args.max_tokens, stages=stages,
                                                busy=lambda: not client.batch_status(batch_id).status.is_finished)
                    still_running = not client.batch_status(batch_id).status.is_finished
                    client.wait(batch_id, timeout_s=3600)
                    rows.append((label + name, latencies, stages,
                                 (batch_seconds(client, batch_id), still_running, alone_s)))
            finally:
                worker.kill()
                client.close()
                delete_queue_keys(redis.Redis.from_url(args.redis_url), queue)
    return rows


def print_rows(args: argparse.Namespace, rows: list) -> None:
    """One run's table: p50 and p99 per phase against the same worker's idle phase, the median
    of each stage, and the bulk batch's time with probes against alone."""
    print(f"{args.bulk} bulk jobs, max_tokens {args.max_tokens}, WEIR_MAX_NUM_SEQS {args.max_num_seqs}, "
          f"WEIR_MAX_NUM_BATCHED_TOKENS {args.max_num_batched_tokens}, "
          f"{args.concurrency or args.max_num_seqs} task threads, {args.probes} probes per phase")
    print(f"{'phase':27s} {'probes':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50/idle':>8s} {'p99/idle':>8s} "
          f"{'claim':>6s} {'run':>6s} {'close':>6s}  bulk")
    for name, lat, stages, bulk in rows:
        if not lat:
            print(f"{name:27s} no probe finished while the bulk batch ran")
            continue
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        idle_p50, idle_p99 = idle_of(rows, name)
        tail = "" if bulk is None else (f"batch took {bulk[0]:.1f} s, {bulk[0] / bulk[2]:.2f}x its {bulk[2]:.1f} s "
                                        "without probes; "
                                        f"{'still running after the last probe' if bulk[1] else 'ended before the last probe'}")
        claim, ran, close = (1e3 * statistics.median(s[k] for s in stages) for k in range(3))
        print(f"{name:27s} {len(lat):6d} {1e3 * p50:8.1f} {1e3 * p99:8.1f} {p50 / idle_p50:8.2f} {p99 / idle_p99:8.2f} "
              f"{claim:6.1f} {ran:6.1f} {close:6.1f}  {tail}")


def idle_of(rows: list, name: str) -> tuple[float, float]:
    """(p50, p99) of the idle phase of the worker that ran phase ``name``."""
    idle = {n[:-len("idle")]: (percentile(lat, 0.5), percentile(lat, 0.99)) for n, lat, _, _ in rows if n.endswith("idle")}
    return next(v for label, v in sorted(idle.items(), key=lambda kv: -len(kv[0])) if name.startswith(label))


def print_medians(runs: list) -> None:
    """Per bulk phase, over the runs: each run's p99 / idle p99 and bulk time with probes / alone,
    and their medians."""
    print(f"over {len(runs)} runs: {'phase':27s} {'p99/idle per run':>28s} {'median':>7s}  {'bulk with/alone per run':>28s} {'median':>7s}")
    for name in [n for n, _, _, bulk in runs[0] if bulk is not None]:
        ratios, slowdowns = [], []
        for rows in runs:
            row = next((r for r in rows if r[0] == name and r[1]), None)
            if row is None:
                continue
            ratios.append(percentile(row[1], 0.99) / idle_of(rows, name)[1])
            slowdowns.append(row[3][0] / row[3][2])
        if not ratios:
            continue
        print(f"{'':13s}{name:27s} {', '.join(f'{r:.2f}' for r in ratios):>28s} {statistics.median(ratios):7.2f}  "
              f"{', '.join(f'{r:.2f}' for r in slowdowns):>28s} {statistics.median(slowdowns):7.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk", type=int, default=2000, help="jobs in the bulk batch")
    ap.add_argument("--probes", type=int, default=30, help="interactive jobs per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the worker's step token budget")
    ap.add_argument("--concurrency", type=int, default=None, help="task threads (default: max_num_seqs)")
    ap.add_argument("--fcfs-baseline", action="store_true", help="also run the bulk batch at priority 0")
    ap.add_argument("--modes", default="default,not-strict,fcfs",
                    help="the workers to run, in this order: default (priority, strict), not-strict, fcfs")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every mode; with more than one, medians follow")
    ap.add_argument("--redis-url", default=REDIS_URL)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
