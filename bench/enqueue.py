"""Producer throughput: enqueue one large batch of short generation requests, streamed.

    python -m bench.enqueue                   # 1,000,000 jobs
    python -m bench.enqueue --jobs 200000 --chunk-size 5000

Needs Redis (``WEIR_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``) and PostgreSQL
(``WEIR_TEST_POSTGRES_URL``, default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``);
it creates a fresh database and a private queue and removes both at the end. No worker runs: the
queue keeps every message until the end (about 1.2 KB of Redis memory per message, so 1,000,000
jobs take about 1.2 GB). The tokenizer is the one of :func:`weir.jobs.testing.save_tiny_chat_model`
(SmolLM2's).

The requests are produced by a generator of dicts, so the client parses each one. Printed: jobs/s
of the whole ``Client.enqueue_batch`` call and of each phase (validation: parsing and length
checks; store: the inserts; publish: stamping and publishing the messages; the rest is reading
the generator and opening/closing the batch), the client's peak RSS (``ru_maxrss``) and the
Redis memory the messages took. Exit status 0 when every message reached the queue.

On 2 cores (Postgres and Redis on the same machine), 1,000,000 jobs: 5,300-5,700 jobs/s overall
(validation about 25,000 jobs/s, store 25,000, publish 10,000), peak RSS 450 MiB of which 426 MiB
is the loaded tokenizer and its libraries, 1.1 GiB of Redis memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator, Optional

from weir.worker.testing import delete_queue_keys, service_urls

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()


def generation_requests(num_jobs: int) -> Iterator[dict[str, Any]]:
    """Short generation requests, as a caller reading a JSONL file would hand them in."""
    for i in range(num_jobs):
        yield {"kind": "generate", "prompt": f"Product {i}: describe it in one sentence.",
               "custom_id": f"bench-{i}", "temperature": 0.0, "max_tokens": 8,
               "metadata": {"product_id": f"p-{i}"}}


class TimingsHandler(logging.Handler):
    """Keeps the ``enqueue_timings`` the client logs at the end of ``enqueue_batch``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.timings: Optional[Any] = None

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "enqueue_timings"):
            self.timings = record.enqueue_timings


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(args: argparse.Namespace) -> int:
    import redis

    from weir import migrations
    from weir.jobs import names
    from weir.jobs.client import Client
    from weir.jobs.testing import temporary_postgres_database
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings

    broker = redis.Redis.from_url(args.redis_url)
    redis_before = broker.info("memory")["used_memory"]
    print(f"redis used_memory before: {redis_before / 2**20:.0f} MiB", flush=True)
    queue = f"weir.enqueue-{uuid.uuid4().hex[:8]}"
    handler = TimingsHandler()
    logging.getLogger("weir.jobs.client").addHandler(handler)
    logging.getLogger("weir.jobs.client").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="weir-enqueue-") as workdir, \
            temporary_postgres_database(POSTGRES_ADMIN_URL, prefix="weir_enqueue_") as database_url:
        model_dir = os.path.join(workdir, "tiny-chat-llama")
        # Saved by a child process: torch and the model weights stay out of this process's peak RSS.
        subprocess.run([sys.executable, "-c", "import sys; from weir.jobs.testing import save_tiny_chat_model; "
                        "save_tiny_chat_model(sys.argv[1])", model_dir], cwd=REPO_ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        migrations.upgrade(database_url)
        client = Client(Settings(
            engine=EngineSettings(model=model_dir),
            worker=WorkerSettings(broker_url=args.redis_url, queue=queue),
            database=DatabaseSettings(database_url=database_url),
        ))
        try:
            client.prompt_checker  # load the tokenizer before the clock starts
            rss_before_mb = peak_rss_mb()
            started = time.perf_counter()
            batch_id = client.enqueue_batch(generation_requests(args.jobs), chunk_size=args.chunk_size)
            wall_s = time.perf_counter() - started
            rss_mb = peak_rss_mb()
            num_messages = broker.llen(names.interactive_queue(queue))  # a priority-0 batch's
            redis_after = broker.info("memory")["used_memory"]
            status = client.batch_status(batch_id)
        finally:
            client.close()
            delete_queue_keys(broker, queue)

    t = handler.timings
    other_s = wall_s - t.validate_s - t.store_s - t.publish_s

    def rate(seconds: float) -> str:
        return f"{args.jobs / seconds:>9,.0f} jobs/s ({seconds:6.1f} s)"

    print(f"jobs {args.jobs:,}  chunk {args.chunk_size:,}  batch {status.status.value} with {status.num_jobs:,} jobs")
    print(f"overall   {rate(wall_s)}")
    print(f"validate  {rate(t.validate_s)}")
    print(f"store     {rate(t.store_s)}")
    print(f"publish   {rate(t.publish_s)}")
    print(f"other     {other_s:6.1f} s (the generator, opening and queueing the batch)")
    print(f"peak RSS  {rss_mb:,.0f} MiB ({rss_before_mb:,.0f} MiB with the tokenizer loaded, before enqueue)")
    print(f"redis     {(redis_after - redis_before) / 2**20:,.0f} MiB for {num_messages:,} messages (deleted)")
    return 0 if num_messages == args.jobs else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.enqueue", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--chunk-size", type=int, default=5_000)
    parser.add_argument("--redis-url", default=REDIS_URL)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
