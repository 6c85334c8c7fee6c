"""How long ``Client.wait`` takes to return once its batch finishes: the ``weir_batch`` channel
against the poll it replaced.

    python -m bench.wait_wake                 # 30 finishes per side, alternating
    python -m bench.wait_wake --finishes 10

One fresh PostgreSQL database, no worker (kombu's in-process ``memory://`` broker; the tiny
model of :func:`weir.jobs.testing.save_tiny_chat_model` for the client's checks): a one-job batch
is enqueued, a thread waits on it, and the main thread claims and stores the job's result
(the worker's own statements, :func:`weir.jobs.claims.claim_jobs` and
:func:`weir.jobs.results.record_results`) after a random 0.05-0.6 s. Measured per finish: from
the result's commit to the wait's return, ms.

- ``channel``: ``Client.wait(batch_id)`` with its default 0.5 s poll: woken by the notification;
- ``poll``: a loop of ``Client.batch_status`` and a 0.5 s sleep, what ``Client.wait`` did before
  the channel (the peer).

Both run in turn in one process against one database; printed: median, mean and max per side and
the ratio of the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from typing import Callable, Optional

from weir.worker.testing import service_urls

POSTGRES_ADMIN_URL = service_urls()[1]
POLL_INTERVAL_S = 0.5


def poll_wait(client, batch_id) -> None:
    """The peer: read the batch every :data:`POLL_INTERVAL_S` until it is finished."""
    while not client.batch_status(batch_id).status.is_finished:
        time.sleep(POLL_INTERVAL_S)


def channel_wait(client, batch_id) -> None:
    client.wait(batch_id, poll_interval_s=POLL_INTERVAL_S, timeout_s=60)


def one_finish(client, wait: Callable, rng: random.Random) -> float:
    """ms from the committed result of a fresh one-job batch to ``wait``'s return."""
    from weir.jobs.claims import claim_jobs
    from weir.jobs.results import JobResult, record_results
    from weir.jobs.db import JobStatus
    from weir.jobs.schemas import GenerateRequest

    batch_id = client.enqueue_batch([GenerateRequest(prompt="a")])
    job_id = client.jobs(batch_id)[0].id
    returned = []
    waiter = threading.Thread(target=lambda: (wait(client, batch_id), returned.append(time.perf_counter())))
    waiter.start()
    time.sleep(rng.uniform(0.05, 0.6))
    with client.session_factory.begin() as session:
        job = claim_jobs(session, [job_id], worker="bench", lease_s=60)[job_id].job
    with client.session_factory.begin() as session:
        record_results(session, [(job, JobResult(status=JobStatus.SUCCEEDED, output_text="x"))])
    committed = time.perf_counter()
    waiter.join(timeout=60)
    assert returned, "the wait did not return within 60 s"
    return (returned[0] - committed) * 1000.0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--finishes", type=int, default=30, help="finishes per side")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from celery import Celery

    from weir import migrations
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client
    from weir.jobs.testing import save_tiny_chat_model, temporary_postgres_database

    rng = random.Random(args.seed)
    model_dir = save_tiny_chat_model(tempfile.mkdtemp(prefix="weir-wake-"))
    with temporary_postgres_database(POSTGRES_ADMIN_URL, prefix="weir_wake_") as database_url:
        migrations.upgrade(database_url)
        client = Client(Settings(engine=EngineSettings(model=model_dir),
                                 worker=WorkerSettings(queue="weir.wake", broker_url=None),
                                 database=DatabaseSettings(database_url=database_url)),
                        celery_app=Celery("weir-wake", broker="memory://localhost//", set_as_current=False))
        try:
            one_finish(client, channel_wait, rng)  # warm-up: the channel's first LISTEN, first connections
            one_finish(client, poll_wait, rng)
            ms: dict[str, list[float]] = {"channel": [], "poll": []}
            for _ in range(args.finishes):
                for name, wait in (("channel", channel_wait), ("poll", poll_wait)):
                    ms[name].append(one_finish(client, wait, rng))
        finally:
            client.close()
    for name, values in ms.items():
        print(f"{name:8s} {len(values)} finishes: median {statistics.median(values):7.1f} ms, "
              f"mean {statistics.mean(values):7.1f} ms, max {max(values):7.1f} ms")
    print(f"poll / channel (medians): {statistics.median(ms['poll']) / statistics.median(ms['channel']):.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
