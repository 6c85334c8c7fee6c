"""Pipeline throughput: weir's whole job path against a bare Celery app that only upserts a row.

    python -m bench.pipeline                                  # 1,000 jobs: weir, baseline, ratio
    python -m bench.pipeline --jobs 1000 --repeat 1           # one run of each (default: 3, medians)
    python -m bench.pipeline --workers 2                      # also two weir workers on one batch
    python -m bench.pipeline --batch-sizes 2000,200000 --drain-jobs 20000
    python -m bench.pipeline --jobs 2000 --per-job-peer            # also weir at priority 0 (per job)
    python -m bench.pipeline --jobs 2000 --chunk-size 256          # WEIR_BULK_CHUNK_SIZE

Needs Redis (``WEIR_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``) and PostgreSQL
(``WEIR_TEST_POSTGRES_URL``, default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``, a
user that may create databases). It creates a fresh database (migrated to head), a private queue
per run, and removes both at the end, with every process it started.

What runs:

- weir: N generation jobs (``max_tokens=1``, temperature 0, prompt ``"Product {i}: describe it."``)
  enqueued as one batch with :meth:`weir.jobs.client.Client.enqueue_batch` (validation, batch and job
  rows; at ``--priority`` 9 by default, a bulk batch: one ``run_chunk`` message per
  ``WEIR_BULK_CHUNK_SIZE`` jobs; at 0 one message per job) to ``python -m weir worker`` subprocesses on the 2-layer
  :func:`weir.jobs.testing.save_tiny_chat_model` (random weights),
  ``WEIR_CONCURRENCY = WEIR_MAX_NUM_SEQS = --concurrency``. The engine is nearly free, so the
  figure is the price of weir's delivery and bookkeeping per job.
- baseline: :mod:`bench.pipeline_baseline`, a bare Celery app with weir's broker and delivery
  settings (threads pool, ``task_acks_late``, prefetch 1, same concurrency, no result backend)
  whose task upserts one row in one transaction (``INSERT .. ON CONFLICT DO UPDATE``). N messages
  carrying one id each are published the way the client publishes (one producer, ``send_task``
  with the client's retry policy); nothing else is stored before publishing.

What is measured (timestamps are the ``finished_at`` each worker writes with its result, on this
machine's clock, so polling adds no error), once both sides are warm: in the default mode each
started worker first runs ``--warmup-jobs`` jobs (256; weir at the timed batch's priority, the
baseline the same number of its tasks), not timed and not counted:

- ``first->end``: (K - 1) / (time of the K-th result - time of the first result), K = the results
  counted (all N unless a drain limit applies): the steady rate once results flow.
- ``publish->end``: K / (time of the K-th result - the moment the first message was published:
  the earliest ``published_at`` of weir's batch, stamped just before its first chunk of messages
  goes; for the baseline the moment before its first ``send_task``): the headline measure, the same
  on both sides.
- ``enqueue->end``: K / (time of the K-th result - the moment ``enqueue_batch`` was called, or the
  first message published for the baseline): also counts weir's validation and row inserts.
- database work per finished job, from ``pg_stat_database`` deltas of the benchmark database (its
  backends are closed before the second reading, so their counters are flushed): ``xact/job``
  (commits), ``db_ms/job`` (``active_time``: time backends spent running statements, lock waits
  included) and ``rows/job`` (``tup_returned``: rows and index entries read). For weir these
  include the producer's inserts and the polling of the batch; ``pg_stat_statements`` is not used
  (it needs ``shared_preload_libraries``).

Modes:

- default: weir (``--workers 1``) and the baseline on ``--jobs`` each, workers started and ready
  before the enqueue; each runs ``--repeat`` times (default 3), alternating, and the ratios use medians.
  Prints ``weir / baseline`` (target >= 0.5). ``--workers 2`` also runs two weir workers on one
  batch and prints their speed-up over one worker.
- ``--batch-sizes 2000,200000``: weir's drain rate per batch size. Each batch is enqueued whole
  before its worker starts; the rate is ``first->end`` over the first ``min(size, --drain-jobs)``
  results, or over those that arrived within ``--drain-timeout-s`` of the first one (the ``timed``
  column says how many were counted). One run per size, on ``--workers`` workers, in one database
  (the sizes run in the order given). Prints the last size's rate over the first's (target >= 0.8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional, TypeVar

from weir.worker.testing import WorkerProcess, delete_queue_keys, service_urls, worker_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()
POLL_INTERVAL_S = 0.2
STAT_COLUMNS = ("xact_commit", "active_time", "tup_returned")
T = TypeVar("T")


@dataclass
class Run:
    """One measured run of one system; rates in results per second."""

    system: str
    num_workers: int
    batch_size: int
    num_timed: int
    enqueue_s: float
    first_to_end_per_s: float
    enqueue_to_end_per_s: Optional[float]
    publish_to_end_per_s: Optional[float]
    num_failed: int
    db_per_job: dict[str, float] = field(default_factory=dict)
    note: str = ""


def rates(stamps: list[datetime], enqueued_at: Optional[datetime]) -> tuple[float, Optional[float]]:
    """(first->end, enqueue->end) rates over the sorted result times ``stamps`` (see the module doc)."""
    if len(stamps) < 2:
        return float("nan"), None
    first_to_end = (len(stamps) - 1) / max((stamps[-1] - stamps[0]).total_seconds(), 1e-9)
    enqueue_to_end = None
    if enqueued_at is not None:
        enqueue_to_end = len(stamps) / max((stamps[-1] - enqueued_at).total_seconds(), 1e-9)
    return first_to_end, enqueue_to_end


class Bench:
    """Owns the benchmark's database, model folder, queues and worker processes.

    Every worker started through :meth:`start` is stopped by :meth:`close`, and every queue named
    by :meth:`new_queue` has its Redis keys deleted there.
    """

    def __init__(self, args: argparse.Namespace, workdir: str, model_dir: str, database_url: str) -> None:
        import redis
        from sqlalchemy import make_url

        from weir.jobs.db import make_engine

        self.args = args
        self.workdir = workdir
        self.model_dir = model_dir
        self.database_url = database_url
        self.database_name = make_url(database_url).database
        self.admin = make_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
        self.redis = redis.Redis.from_url(args.redis_url)
        self.workers: list[WorkerProcess] = []
        self.queues: list[str] = []
        self._prompt_checker = None

    # -- processes and queues ------------------------------------------------------------------

    def new_queue(self, system: str) -> str:
        queue = f"weir.bench-pipeline-{system}-{uuid.uuid4().hex[:8]}"
        self.queues.append(queue)
        return queue

    def start(self, system: str, queue: str, num_workers: int) -> list[WorkerProcess]:
        """Start ``num_workers`` workers of ``system`` ("weir" or "baseline") on ``queue``; wait until ready."""
        concurrency = self.args.concurrency
        common = dict(broker_url=self.args.redis_url, queue=queue, database_url=self.database_url,
                      concurrency=concurrency, python_path=[REPO_ROOT])
        if system == "weir":
            env = worker_env(model=self.model_dir, WEIR_SHUTDOWN_TIMEOUT_S=5, **common)
        else:
            env = worker_env(**common)
        started = []
        for _ in range(num_workers):
            n = len(self.workers)
            if system == "weir":
                argv = [sys.executable, "-m", "weir", "worker", "--loglevel", "WARNING"]  # as the baseline
            else:
                argv = [sys.executable, "-m", "celery", "-A", "bench.pipeline_baseline", "worker", "-P", "threads",
                        "-c", str(concurrency), "-Q", queue, "-n", f"pipeline-baseline-{n}@%h", "--loglevel",
                        "WARNING", "--without-mingle", "--without-gossip"]  # as `weir worker` starts Celery
            worker = WorkerProcess(env, os.path.join(self.workdir, f"{system}-{n}.log"), argv, cwd=REPO_ROOT)
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_ready(ping=system == "weir")  # weir logs no ready line at WARNING
        return started

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(grace_s=5)
        for queue in self.queues:
            delete_queue_keys(self.redis, queue)
        self.admin.dispose()

    # -- database --------------------------------------------------------------------------------

    def query(self, fn: Callable[..., T]) -> T:
        """Run ``fn(connection)`` in one transaction on a connection that is closed afterwards
        (so that its statistics are flushed and it is not counted as a worker's backend)."""
        from weir.jobs.db import make_engine

        engine = make_engine(self.database_url)
        try:
            with engine.begin() as connection:
                return fn(connection)
        finally:
            engine.dispose()

    def db_stats(self, wait_for_backends: bool = True) -> dict[str, float]:
        """Cumulative ``pg_stat_database`` counters of the benchmark database, read once no
        backend is connected to it (at most 30 s) unless ``wait_for_backends`` is false."""
        from sqlalchemy import text

        with self.admin.connect() as connection:
            deadline = time.monotonic() + 30
            while wait_for_backends and time.monotonic() < deadline:
                n = connection.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE datname = :name"),
                                      {"name": self.database_name})
                if n == 0:
                    break
                time.sleep(0.1)
            row = connection.execute(
                text(f"SELECT {', '.join(STAT_COLUMNS)} FROM pg_stat_database WHERE datname = :name"),
                {"name": self.database_name},
            ).one()
        return dict(zip(STAT_COLUMNS, map(float, row)))

    @staticmethod
    def per_job(before: dict[str, float], after: dict[str, float], num_jobs: int) -> dict[str, float]:
        return {name: (after[name] - before[name]) / max(num_jobs, 1) for name in STAT_COLUMNS}

    # -- weir ------------------------------------------------------------------------------------

    def client(self, queue: str):
        from weir.jobs.client import Client
        from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings

        client = Client(
            Settings(
                engine=EngineSettings(model=self.model_dir),
                worker=WorkerSettings(broker_url=self.args.redis_url, queue=queue,
                                      **({"bulk_chunk_size": self.args.chunk_size} if self.args.chunk_size else {})),
                database=DatabaseSettings(database_url=self.database_url),
            ),
            prompt_checker=self._prompt_checker,
        )
        self._prompt_checker = client.prompt_checker  # the tokenizer loads once, before any clock
        return client

    def run_weir(self, num_jobs: int, num_workers: int, *, drain: bool = False, priority: Optional[int] = None) -> Run:
        """One batch of ``num_jobs`` through ``num_workers`` weir workers, at ``priority``
        (default ``--priority``: above 0 a bulk batch, published in chunks; 0 one message per job).

        ``drain``: enqueue first, then start the workers, and count only the first
        ``--drain-jobs`` results (or those within ``--drain-timeout-s`` of the first result).
        """
        from sqlalchemy import func, select

        from weir.jobs.db import Job, JobStatus
        from weir.jobs.schemas import GenerateRequest

        priority = self.args.priority if priority is None else priority
        queue = self.new_queue("weir")
        client = self.client(queue)
        requests = [
            GenerateRequest(prompt=f"Product {i}: describe it.", custom_id=f"job-{i}", temperature=0.0, max_tokens=1)
            for i in range(num_jobs)
        ]
        target = min(num_jobs, self.args.drain_jobs) if drain else num_jobs
        workers: list[WorkerProcess] = []
        note = ""
        try:
            if not drain:
                workers = self.start("weir", queue, num_workers)
                self.warm_up_weir(client, priority, workers)
                before = self.db_stats(wait_for_backends=False)
            enqueued_at = datetime.now(timezone.utc)
            started = time.monotonic()
            batch_id = client.enqueue_batch(requests, priority=priority)
            enqueue_s = time.monotonic() - started
            if drain:
                client.engine.dispose()  # its counters flush; the next poll opens a new connection
                before = self.db_stats()
                workers = self.start("weir", queue, num_workers)
            deadline = time.monotonic() + self.args.timeout_s
            first_result_at: Optional[float] = None
            while True:
                progress = client.batch_status(batch_id)
                if progress.num_finished and first_result_at is None:
                    first_result_at = time.monotonic()
                if progress.status.is_finished or progress.num_finished >= target:
                    break
                if time.monotonic() > deadline:
                    note = f"timed out after {self.args.timeout_s:g}s"
                    break
                if drain and first_result_at is not None \
                        and time.monotonic() - first_result_at > self.args.drain_timeout_s:
                    note = f"stopped {self.args.drain_timeout_s:g}s after the first result"
                    break
                for worker in workers:
                    worker.check_alive()
                time.sleep(POLL_INTERVAL_S)
        finally:
            for worker in workers:
                worker.stop()
            client.close()
        after = self.db_stats()
        finished = (JobStatus.SUCCEEDED, JobStatus.FAILED)

        def read(connection):
            rows = connection.execute(
                select(Job.finished_at, Job.status).where(Job.batch_id == batch_id, Job.status.in_(finished))
                .order_by(Job.finished_at)
            ).all()
            first_published = connection.scalar(select(func.min(Job.published_at)).where(Job.batch_id == batch_id))
            return [r.finished_at for r in rows], sum(r.status == JobStatus.FAILED for r in rows), first_published

        stamps, num_failed, first_published = self.query(read)
        first_to_end, enqueue_to_end = rates(stamps[:target], None if drain else enqueued_at)
        publish_to_end = None if drain else rates(stamps[:target], first_published)[1]
        delete_queue_keys(self.redis, queue)
        return Run(f"weir p{priority}", num_workers, num_jobs, min(target, len(stamps)), enqueue_s, first_to_end, enqueue_to_end,
                   publish_to_end, num_failed, self.per_job(before, after, len(stamps)), note)

    def warm_up_weir(self, client, priority: int, workers: list[WorkerProcess]) -> None:
        """``--warmup-jobs`` jobs through the ready workers, timed by no figure: the producer's
        tokenizer, the workers' connections, statements and engine steps are warm when the timed
        batch is published."""
        from weir.jobs.schemas import GenerateRequest

        if not self.args.warmup_jobs:
            return
        batch_id = client.enqueue_batch(
            [GenerateRequest(prompt=f"Warm-up {i}: describe it.", temperature=0.0, max_tokens=1)
             for i in range(self.args.warmup_jobs)], priority=priority)
        while not client.batch_status(batch_id).status.is_finished:
            for worker in workers:
                worker.check_alive()
            time.sleep(POLL_INTERVAL_S)

    # -- baseline --------------------------------------------------------------------------------

    def create_baseline_table(self) -> None:
        from sqlalchemy import text

        from bench.pipeline_baseline import CREATE_TABLE

        self.query(lambda connection: connection.execute(text(CREATE_TABLE)))

    def run_baseline(self, num_tasks: int) -> Run:
        """``num_tasks`` messages through one baseline worker, each upserting one row."""
        from sqlalchemy import func, select, table, column, text

        from bench.pipeline_baseline import STORE_RESULT, TABLE
        from weir.jobs.client import PUBLISH_RETRY_POLICY
        from weir.jobs.db import make_engine

        results = table(TABLE, column("finished_at"))
        queue = self.new_queue("baseline")
        self.query(lambda connection: connection.execute(text(f"TRUNCATE {TABLE}")))
        row_ids = [str(uuid.uuid4()) for _ in range(num_tasks)]
        publisher = self.client(queue)
        app = publisher.celery_app
        poller = make_engine(self.database_url)
        workers: list[WorkerProcess] = []
        note = ""
        try:
            workers = self.start("baseline", queue, 1)
            if self.args.warmup_jobs:  # as warm as weir's workers: connections, statements, the producer
                with app.producer_or_acquire() as producer:
                    for _ in range(self.args.warmup_jobs):
                        app.send_task(STORE_RESULT, args=[str(uuid.uuid4())], queue=queue, producer=producer,
                                      retry=True, retry_policy=PUBLISH_RETRY_POLICY)
                while True:
                    with poller.connect() as connection:
                        if connection.scalar(select(func.count()).select_from(results)) >= self.args.warmup_jobs:
                            break
                    workers[0].check_alive()
                    time.sleep(POLL_INTERVAL_S)
                self.query(lambda connection: connection.execute(text(f"TRUNCATE {TABLE}")))
            before = self.db_stats(wait_for_backends=False)
            enqueued_at = datetime.now(timezone.utc)
            started = time.monotonic()
            with app.producer_or_acquire() as producer:
                for row_id in row_ids:
                    app.send_task(STORE_RESULT, args=[row_id], queue=queue, producer=producer,
                                  retry=True, retry_policy=PUBLISH_RETRY_POLICY)
            enqueue_s = time.monotonic() - started
            deadline = time.monotonic() + self.args.timeout_s
            while True:
                with poller.connect() as connection:
                    if connection.scalar(select(func.count()).select_from(results)) >= num_tasks:
                        break
                if time.monotonic() > deadline:
                    note = f"timed out after {self.args.timeout_s:g}s"
                    break
                workers[0].check_alive()
                time.sleep(POLL_INTERVAL_S)
        finally:
            for worker in workers:
                worker.stop()
            poller.dispose()
            publisher.close()
            app.close()
        after = self.db_stats()
        stamps = self.query(lambda connection: list(
            connection.scalars(select(results.c.finished_at).order_by(results.c.finished_at))))
        first_to_end, enqueue_to_end = rates(stamps, enqueued_at)
        delete_queue_keys(self.redis, queue)
        return Run("baseline", 1, num_tasks, len(stamps), enqueue_s, first_to_end, enqueue_to_end, enqueue_to_end, 0,
                   self.per_job(before, after, len(stamps)), note)


# -- report ----------------------------------------------------------------------------------------

HEADER = ("system", "workers", "batch", "timed", "enqueue_s", "first->end/s", "publish->end/s", "enqueue->end/s",
          "xact/job", "db_ms/job", "rows/job", "note")


def row(run: Run) -> tuple:
    db = run.db_per_job
    enqueue_to_end = "-" if run.enqueue_to_end_per_s is None else f"{run.enqueue_to_end_per_s:.1f}"
    publish_to_end = "-" if run.publish_to_end_per_s is None else f"{run.publish_to_end_per_s:.1f}"
    note = "; ".join(filter(None, [run.note, f"{run.num_failed} failed" if run.num_failed else ""]))
    return (run.system, run.num_workers, run.batch_size, run.num_timed, f"{run.enqueue_s:.2f}",
            f"{run.first_to_end_per_s:.1f}", publish_to_end, enqueue_to_end, f"{db.get('xact_commit', 0):.2f}",
            f"{db.get('active_time', 0):.2f}", f"{db.get('tup_returned', 0):.0f}", note)


def print_table(runs: list[Run]) -> None:
    rows = [HEADER] + [tuple(map(str, row(r))) for r in runs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        print("  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(r, widths))))


def median_rate(runs: list[Run], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def print_ratio(name: str, numerator: float, denominator: float, target: Optional[float] = None) -> None:
    ratio = numerator / denominator if denominator else float("nan")
    aim = f"  (target >= {target:g})" if target is not None else ""
    print(f"{name} = {ratio:.2f}  ({numerator:.1f} / {denominator:.1f}){aim}")


def throughput(bench: Bench, args: argparse.Namespace) -> None:
    weir_runs, baseline_runs, multi_runs, per_job_runs = [], [], [], []
    for _ in range(args.repeat):
        weir_runs.append(bench.run_weir(args.jobs, 1))
        baseline_runs.append(bench.run_baseline(args.jobs))
        if args.per_job_peer and args.priority > 0:
            per_job_runs.append(bench.run_weir(args.jobs, 1, priority=0))
        if args.workers > 1:
            multi_runs.append(bench.run_weir(args.jobs, args.workers))
    print_table(weir_runs + per_job_runs + baseline_runs + multi_runs)
    median = "median of %d runs, " % args.repeat if args.repeat > 1 else ""
    target = 3.0 if args.priority > 0 else 0.5
    print_ratio(f"weir p{args.priority} / baseline ({median}first result to end)",
                median_rate(weir_runs, "first_to_end_per_s"), median_rate(baseline_runs, "first_to_end_per_s"),
                target=target)
    print_ratio(f"weir p{args.priority} / baseline ({median}first publish to end)",
                median_rate(weir_runs, "publish_to_end_per_s"), median_rate(baseline_runs, "publish_to_end_per_s"),
                target=target)
    print_ratio(f"weir p{args.priority} / baseline ({median}enqueue to end)",
                median_rate(weir_runs, "enqueue_to_end_per_s"), median_rate(baseline_runs, "enqueue_to_end_per_s"),
                target=target)
    if per_job_runs:
        print_ratio(f"weir p0 (one message per job) / baseline ({median}first result to end)",
                    median_rate(per_job_runs, "first_to_end_per_s"), median_rate(baseline_runs, "first_to_end_per_s"))
    if multi_runs:
        print_ratio(f"weir {args.workers} workers / 1 worker ({median}first result to end)",
                    median_rate(multi_runs, "first_to_end_per_s"), median_rate(weir_runs, "first_to_end_per_s"))


def drain(bench: Bench, args: argparse.Namespace) -> None:
    runs = [bench.run_weir(size, args.workers, drain=True) for size in args.batch_sizes]
    print_table(runs)
    print(f"drain rate: first->end over the first min(batch, {args.drain_jobs}) results, "
          f"or those within {args.drain_timeout_s:g}s of the first result")
    if len(runs) > 1:
        print_ratio(f"weir drain rate, batch {runs[-1].batch_size} / batch {runs[0].batch_size}",
                    runs[-1].first_to_end_per_s, runs[0].first_to_end_per_s, target=0.8)


def run(args: argparse.Namespace) -> int:
    from weir import migrations
    from weir.jobs.testing import save_tiny_chat_model, temporary_postgres_database

    workdir = tempfile.mkdtemp(prefix="weir-pipeline-")
    model_dir = save_tiny_chat_model(os.path.join(workdir, "tiny-chat-llama"))
    with temporary_postgres_database(args.postgres_url, prefix="weir_pipeline_") as database_url:
        migrations.upgrade(database_url)
        bench = Bench(args, workdir, model_dir, database_url)
        try:
            bench.create_baseline_table()
            print(f"concurrency {args.concurrency}; logs in {workdir}", flush=True)
            if args.batch_sizes:
                drain(bench, args)
            else:
                throughput(bench, args)
        finally:
            bench.close()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per run (default mode)")
    parser.add_argument("--concurrency", type=int, default=32, help="task threads per worker (and max_num_seqs)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each system; ratios use medians")
    parser.add_argument("--workers", type=int, default=1, help="weir workers on one batch; >1 also prints the speed-up")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="drain mode: comma-separated batch sizes, e.g. 2000,200000")
    parser.add_argument("--drain-jobs", type=int, default=20_000, help="drain mode: results counted per batch")
    parser.add_argument("--drain-timeout-s", type=float, default=300.0,
                        help="drain mode: stop counting this long after the first result")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on one run after this long")
    parser.add_argument("--priority", type=int, default=9,
                        help="weir's batch priority: above 0 a bulk batch, in chunks (default 9, the catalog's); "
                        "0 one message per job")
    parser.add_argument("--chunk-size", type=int, default=None, help="WEIR_BULK_CHUNK_SIZE (default: the setting's)")
    parser.add_argument("--warmup-jobs", type=int, default=256,
                        help="jobs through each started worker before the timed batch (default mode; 0: none)")
    parser.add_argument("--per-job-peer", action="store_true",
                        help="also run weir at priority 0 (one message per job) in each repeat")
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--postgres-url", default=POSTGRES_ADMIN_URL)
    args = parser.parse_args(argv)
    if min([args.jobs, args.concurrency, args.repeat, args.workers, args.drain_jobs] + (args.batch_sizes or [1])) < 1:
        parser.error("counts must be >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
