"""Soak test: many short jobs through several ``weir worker`` processes that are SIGKILLed at random.

    python -m bench.soak                      # 10,000 jobs, 2 workers, a kill every 2-6 s
    python -m bench.soak --jobs 500 --kill-every-s 1 3
    python -m bench.soak --priority 9 --chunk-size 64   # bulk batches: chunks, not one message per job

Needs Redis (``WEIR_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``) and PostgreSQL
(``WEIR_TEST_POSTGRES_URL``, default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``);
it creates a fresh database and a private queue and removes both at the end. The visibility
timeout is 8 s, leases last 6 s, and the sweeper runs every 5 s (grace 3 s), as ``weir worker
--beat`` would run it. The model is
:func:`weir.jobs.testing.save_tiny_chat_model` (random weights), so the run measures delivery, not
inference. Each killed worker is started again at once. At the end it counts, from the database:

- ``lost``: jobs not ``succeeded`` (queued, running, failed or cancelled) once the batch finished
  or the time ran out;
- ``duplicated``: rows beyond one per job (by ``custom_id``) plus product-enrichment rows beyond
  one per product;
- ``redelivered``: jobs started more than once (``attempts > 1``), which is allowed;
- engine runs per job (each logged by the fault tests' hook, ``tests/worker/crash_hook``): no
  job may run more often than its ``attempts``;
- batches whose counters differ from a recount (:func:`weir.jobs.counters.reconcile_batches`);

and prints them with the throughput (jobs per second from the first publish to the last result).
Exit status 0 when all of lost, duplicated, jobs over their attempts and drifted batches are 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
import uuid
from typing import Optional

from weir.worker.testing import WorkerProcess, delete_queue_keys, service_urls, worker_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VISIBILITY_TIMEOUT_S = 8
LEASE_S = 6
SWEEP_AFTER_S = 3
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()


def run(args: argparse.Namespace) -> int:
    import redis
    from sqlalchemy import func, select

    from weir import migrations
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs import counters
    from weir.jobs.catalog.tables import ProductEnrichment
    from weir.jobs.client import Client
    from weir.jobs.db import Job, JobStatus
    from weir.jobs.schemas import GenerateRequest
    from weir.jobs.testing import save_tiny_chat_model, temporary_postgres_database

    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="weir-soak-")
    model_dir = save_tiny_chat_model(os.path.join(workdir, "tiny-chat-llama"))
    queue = f"weir.soak-{uuid.uuid4().hex[:8]}"
    run_log = os.path.join(workdir, "engine-runs.log")
    with temporary_postgres_database(POSTGRES_ADMIN_URL, prefix="weir_soak_") as database_url:
        migrations.upgrade(database_url)
        # The fault tests' hook logs every engine run of a job (one line per run), so the soak
        # counts engine runs per job, an effect, not rows.
        env = worker_env(
            broker_url=args.redis_url, queue=queue, database_url=database_url, model=model_dir,
            concurrency=args.concurrency,
            python_path=[os.path.join(REPO_ROOT, "tests", "worker", "crash_hook"), REPO_ROOT],
            # Fast redelivery of a killed worker's messages; the limits nest as README "Guarantees" says.
            WEIR_VISIBILITY_TIMEOUT_S=VISIBILITY_TIMEOUT_S, WEIR_JOB_TIMEOUT_S=2, WEIR_DB_RETRY_TIMEOUT_S=2,
            # A killed worker's leases run out after 6 s; the survivors renew theirs every second.
            WEIR_LEASE_S=LEASE_S, WEIR_CANCEL_POLL_INTERVAL_S=1,
            WEIR_TEST_RUN_LOG=run_log,
            **({"WEIR_BULK_CHUNK_SIZE": args.chunk_size} if args.chunk_size else {}),
        )
        client = Client(Settings(
            engine=EngineSettings(model=model_dir),
            worker=WorkerSettings(broker_url=args.redis_url, queue=queue, visibility_timeout_s=VISIBILITY_TIMEOUT_S,
                                  sweep_after_s=SWEEP_AFTER_S,
                                  **({"bulk_chunk_size": args.chunk_size} if args.chunk_size else {})),
            database=DatabaseSettings(database_url=database_url),
        ))
        num_started = 0

        def start() -> WorkerProcess:
            nonlocal num_started
            num_started += 1
            return WorkerProcess(env, os.path.join(workdir, f"worker-{num_started}.log"), cwd=REPO_ROOT)

        workers = [start() for _ in range(args.workers)]
        try:
            while not all(w.is_ready() for w in workers):
                time.sleep(0.2)
            requests = [
                GenerateRequest(prompt=f"Product {i}: describe it.", custom_id=f"soak-{i}", temperature=0,
                                max_tokens=args.max_tokens, metadata={"product_id": f"p-{i}"},
                                extensions={"enrichment": {"catalog": "soak", "product_id": f"p-{i}"}})
                for i in range(args.jobs)
            ]
            started = time.monotonic()
            batch_ids = [client.enqueue_batch(requests[i:i + args.batch_size], priority=args.priority)
                         for i in range(0, args.jobs, args.batch_size)]
            print(f"{args.jobs} jobs published in {time.monotonic() - started:.1f}s; {args.workers} workers, "
                  f"a kill every {args.kill_every_s[0]:g}-{args.kill_every_s[1]:g}s", flush=True)
            num_kills = num_republished = 0
            next_kill = time.monotonic() + rng.uniform(*args.kill_every_s)
            next_sweep = time.monotonic() + args.sweep_every_s
            finished_at: Optional[float] = None
            deadline = started + args.timeout_s
            while time.monotonic() < deadline:
                statuses = [client.batch_status(b) for b in batch_ids]
                done = sum(s.num_finished for s in statuses)
                if all(s.status.is_finished for s in statuses):
                    finished_at = time.monotonic()
                    break
                if time.monotonic() >= next_sweep:
                    # What `weir worker --beat` does every WEIR_SWEEP_INTERVAL_S: a message BRPOPed
                    # by a worker killed before kombu recorded it as unacked is gone from Redis.
                    num_republished += client.sweep()
                    next_sweep = time.monotonic() + args.sweep_every_s
                ready = [i for i, w in enumerate(workers) if w.is_ready()]
                # Kill only while another worker serves the queue: a kill must cost redeliveries,
                # not a stretch with no worker at all (a restart takes seconds on 2 cores).
                if time.monotonic() >= next_kill and len(ready) >= 2:
                    victim = rng.choice(ready)
                    workers[victim].kill()
                    workers[victim] = start()
                    num_kills += 1
                    next_kill = time.monotonic() + rng.uniform(*args.kill_every_s)
                    print(f"  {time.monotonic() - started:6.1f}s  {done:>6} done  SIGKILL #{num_kills}", flush=True)
                time.sleep(0.2)
            elapsed_s = (finished_at or time.monotonic()) - started
        finally:
            for worker in workers:
                worker.kill()

        with client.session_factory() as session:
            in_batches = Job.batch_id.in_(batch_ids)
            by_status = dict(session.execute(select(Job.status, func.count()).where(in_batches).group_by(Job.status)).all())
            num_rows = session.scalar(select(func.count()).select_from(Job).where(in_batches))
            num_distinct = session.scalar(select(func.count(func.distinct(Job.custom_id))).where(in_batches))
            num_redelivered = session.scalar(select(func.count()).select_from(Job).where(in_batches, Job.attempts > 1))
            max_attempts = session.scalar(select(func.max(Job.attempts)).where(in_batches))
            num_enriched = session.scalar(select(func.count()).select_from(ProductEnrichment))
            num_products = session.scalar(select(func.count(func.distinct(ProductEnrichment.product_id))))
            attempts = {str(job_id): n for job_id, n in session.execute(select(Job.id, Job.attempts).where(in_batches))}
        with client.session_factory.begin() as session:  # the counters against a recount
            drifted = counters.reconcile_batches(session, batch_ids)
        with open(run_log) as f:
            engine_runs = collections.Counter(f.read().split())
        client.close()
        delete_queue_keys(redis.Redis.from_url(args.redis_url), queue)

    num_succeeded = by_status.get(JobStatus.SUCCEEDED, 0)
    lost = args.jobs - num_succeeded
    duplicated = (num_rows - num_distinct) + (num_enriched - num_products)
    print(f"jobs {args.jobs}  succeeded {num_succeeded}  statuses {{{', '.join(f'{k.value}: {v}' for k, v in by_status.items())}}}")
    print(f"SIGKILLs {num_kills}  redelivered {num_redelivered} (max attempts {max_attempts})  "
          f"published again by the sweeper {num_republished}  enrichment rows {num_enriched}")
    over = sum(1 for job_id, n in engine_runs.items() if n > attempts.get(job_id, 0))
    print(f"engine runs {sum(engine_runs.values())} for {len(engine_runs)} jobs; jobs with more engine runs "
          f"than attempts = {over}; batches whose counters differ from a recount = {len(drifted)}")
    print(f"lost = {lost}")
    print(f"duplicated = {duplicated}")
    print(f"throughput = {num_succeeded / elapsed_s:.1f} jobs/s ({elapsed_s:.1f}s wall, finished: {finished_at is not None})")
    return 0 if lost == duplicated == over == len(drifted) == 0 else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="task threads per worker")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1000, help="jobs per enqueued batch")
    parser.add_argument("--kill-every-s", type=float, nargs=2, default=(2.0, 6.0), metavar=("MIN", "MAX"))
    parser.add_argument("--sweep-every-s", type=float, default=5.0, help="run the sweeper this often")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--priority", type=int, default=None,
                        help="every batch's priority: above 0 a bulk batch, published in chunks (run_chunk); "
                             "default: each job's own (0, one message per job)")
    parser.add_argument("--chunk-size", type=int, default=None, help="WEIR_BULK_CHUNK_SIZE of the client and workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=REDIS_URL)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
