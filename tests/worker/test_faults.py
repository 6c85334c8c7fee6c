"""Fault injection against real ``weir worker`` processes, real Redis and real Postgres.

Every test ends by checking each job's row (the state README "Guarantees" promises, with the
number of attempts its deliveries took) and, where a fault could make a job run or be stored
twice, by counting effects the primary key cannot hide: engine runs per job (the ``hooked``
fixture's run log) and result writes per job (the ``effects`` fixture's triggers). Tests that must
catch jobs in flight run the 16-layer ``slow_model_dir``, so the engine's own speed-ups do not let
a batch finish before the fault lands.
"""

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis
from sqlalchemy import make_url, select, text

from weir.jobs import names
from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.db import BatchStatus, DeadLetter, Job, JobStatus
from weir.jobs.schemas import ClassifyRequest, GenerateRequest

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))
# Redis gives an unacked message back 6 s after its fetch; an attempt may take 2 s, a result
# write may retry 1 s: 2 * 2 + 1 < 6, the consistent setting for fast redelivery. A killed
# worker's claims hold their jobs until their 5 s leases lapse (renewed every 0.5 s while they run).
FAST_REDELIVERY = dict(WEIR_VISIBILITY_TIMEOUT_S="6", WEIR_JOB_TIMEOUT_S="2", WEIR_DB_RETRY_TIMEOUT_S="1",
                       WEIR_LEASE_S="5", WEIR_CANCEL_POLL_INTERVAL_S="0.5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s=120.0, interval_s=0.05, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached after {timeout_s}s")


def rows(client, batch_id):
    """custom_id -> (status, attempts, worker, output_text) of every row of the batch."""
    with client.session_factory() as session:
        found = session.execute(
            select(Job.custom_id, Job.status, Job.attempts, Job.worker, Job.output_text)
            .where(Job.batch_id == batch_id)
        ).all()
    table = {r.custom_id: (r.status, r.attempts, r.worker, r.output_text) for r in found}
    assert len(table) == len(found), "a custom_id has two rows"
    return table


def num_just_claimed(client, batch_id, worker=None, within_s=0.2):
    """Running jobs claimed in the last ``within_s`` seconds (database clock): a kill now cuts
    them short, since each needs several times that to finish."""
    query = ("SELECT count(*) FROM jobs WHERE batch_id = :batch AND status = 'running' "
             "AND claimed_at > now() - make_interval(secs => :within)")
    params = {"batch": batch_id, "within": within_s}
    if worker is not None:
        query += " AND worker = :worker"
        params["worker"] = worker
    with client.session_factory() as session:
        return session.execute(text(query), params).scalar_one()


def with_status(table, status):
    return {custom_id for custom_id, row in table.items() if row[0] == status}


def generate_batch(client, num_jobs, max_tokens, prefix="job"):
    return client.enqueue_batch([
        GenerateRequest(prompt=f"Product number {i}", custom_id=f"{prefix}-{i}", temperature=0, max_tokens=max_tokens)
        for i in range(num_jobs)
    ])


def assert_runs_and_writes(client, batch_id, runs, effects, cut_short=()):
    """Each job ran in the engine once, but a job in ``cut_short`` (custom_ids a fault caught
    claimed) once or twice (a claim not yet in the engine when the fault hit never started its
    run); no job ran more often than it was claimed (``attempts``); each job's outcome was
    written once."""
    jobs = {job.custom_id: job for job in client.jobs(batch_id)}
    counted = runs()
    wrong = {c: (counted[str(j.id)], j.attempts) for c, j in jobs.items()
             if not (counted[str(j.id)] == 1 or c in cut_short and 1 <= counted[str(j.id)] <= j.attempts)}
    assert wrong == {}, "custom_id: (engine runs, attempts)"
    assert effects("jobs", [j.id for j in jobs.values()]) == {str(j.id): 1 for j in jobs.values()}


def assert_each_succeeded_once(client, batch_id, num_jobs, prefix="job"):
    final = client.batch_status(batch_id)
    table = rows(client, batch_id)
    assert sorted(table) == sorted(f"{prefix}-{i}" for i in range(num_jobs))
    assert with_status(table, JobStatus.SUCCEEDED) == set(table)
    assert (final.status, final.num_succeeded, final.num_failed, final.num_cancelled) == (
        BatchStatus.COMPLETED, num_jobs, 0, 0)
    return table


def test_sigkill_mid_batch_then_restart_runs_only_the_cut_short_jobs_again(start_worker, client, slow_model_dir,
                                                                            hooked, effects):
    env, runs = hooked
    num_jobs = 50
    settings = dict(env, **FAST_REDELIVERY, WEIR_MODEL=slow_model_dir)
    worker = start_worker(**settings)
    batch_id = generate_batch(client, num_jobs, max_tokens=96)  # ~0.6 s each on the slow model
    wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 8 and num_just_claimed(client, batch_id),
               what="8 done, a job just started")
    worker.sigkill()
    at_kill = rows(client, batch_id)
    interrupted = with_status(at_kill, JobStatus.RUNNING)
    assert interrupted and 8 <= len(with_status(at_kill, JobStatus.SUCCEEDED)) < num_jobs

    start_worker(**settings)
    client.wait(batch_id, timeout_s=120)

    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    # The jobs the kill cut short ran once more (Redis redelivered them); no other job did.
    assert {c: row[1] for c, row in table.items()} == {c: 2 if c in interrupted else 1 for c in table}
    assert_runs_and_writes(client, batch_id, runs, effects, interrupted)


def test_sigterm_puts_jobs_past_the_grace_period_back_and_restart_finishes_them(start_worker, client, slow_model_dir,
                                                                              hooked, effects):
    env, runs = hooked
    num_jobs = 8
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2", WEIR_SHUTDOWN_TIMEOUT_S="0.2")
    worker = start_worker(**settings)
    batch_id = generate_batch(client, num_jobs, max_tokens=240)  # ~1.5 s each on the slow model
    done = wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 2 and
                      client.batch_status(batch_id).num_succeeded, what="2 jobs done")
    # Right after a job finishes its thread starts the next one, which needs ~7x the grace period;
    # wait for its claim too (signalled between jobs, both threads' messages go back unclaimed).
    wait_until(lambda: client.batch_status(batch_id).num_succeeded > done and
               num_just_claimed(client, batch_id, within_s=0.5), interval_s=0.01, what="next job claimed")
    started = time.monotonic()
    assert worker.terminate(timeout_s=60) == 0
    shutdown_s = time.monotonic() - started

    stopped = rows(client, batch_id)
    # Put back: the lease given back (queued again) with the cut-short start counted.
    put_back = {c for c, row in stopped.items() if row[0] == JobStatus.QUEUED and row[1] == 1}
    assert with_status(stopped, JobStatus.RUNNING) == set()
    assert shutdown_s < 10, f"warm shutdown took {shutdown_s:.1f}s with a 0.2 s grace period"
    assert put_back, "a job past the grace period must have been put back"
    assert with_status(stopped, JobStatus.FAILED) == set()
    assert f"shutdown grace period over: {len(put_back)} running jobs go back to the queue" in worker.log()

    start_worker(**env, WEIR_MODEL=slow_model_dir)
    client.wait(batch_id, timeout_s=180)

    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert {c: row[1] for c, row in table.items()} == {c: 2 if c in put_back else 1 for c in table}
    assert_runs_and_writes(client, batch_id, runs, effects, put_back)


@pytest.fixture
def private_redis(tmp_path):
    """A ``redis-server`` of this test alone, without persistence, that the test may restart."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(tmp_path)]
    procs = []

    def start():
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        import redis

        wait_until(lambda: _pings(redis, port), timeout_s=10, what="redis up")
        return proc

    start()
    yield port, procs, start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pings(redis, port):
    try:
        return redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except redis.exceptions.ConnectionError:
        return False


def test_redis_restart_mid_batch_worker_reconnects_and_sweeper_republishes_lost_messages(
    private_redis, start_worker, worker_env, slow_model_dir, hooked, effects
):
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client

    port, procs, start_redis = private_redis
    broker_url = f"redis://127.0.0.1:{port}/0"
    num_jobs = 50
    env, runs = hooked
    worker = start_worker(**env, WEIR_BROKER_URL=broker_url, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="2",
                          WEIR_MAX_NUM_SEQS="2")
    client = Client(Settings(
        engine=EngineSettings(model=worker_env["WEIR_MODEL"]),
        worker=WorkerSettings(broker_url=broker_url, queue=worker_env["WEIR_QUEUE"]),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"]),
    ))
    try:
        batch_id = generate_batch(client, num_jobs, max_tokens=32)
        wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 6, what="6 jobs done")
        procs[-1].kill()  # Redis dies without saving: every queued and unacked message is gone
        procs[-1].wait()
        time.sleep(1)
        start_redis()
        num_republished = 0
        deadline = time.monotonic() + 120
        while not client.batch_status(batch_id).status.is_finished:
            assert time.monotonic() < deadline, "batch not finished 120 s after the Redis restart"
            # What a periodic sweeper with a 3 s deadline does.
            num_republished += client.sweep(older_than_s=3)
            time.sleep(1)

        assert_each_succeeded_once(client, batch_id, num_jobs)
        assert num_republished >= 1
        # a republished message of a job that ran meanwhile ran nothing: runs <= starts, one write
        assert_runs_and_writes(client, batch_id, runs, effects, cut_short={f"job-{i}" for i in range(num_jobs)})
        assert worker.is_alive()
        assert "Connection to broker lost" in worker.log()
    finally:
        client.close()


def test_postgres_outage_of_10_s_mid_batch_loses_and_acks_nothing(start_worker, client, worker_env, slow_model_dir,
                                                                  hooked, effects):
    proxy_port = free_port()
    url = make_url(worker_env["WEIR_DATABASE_URL"])
    proxy_command = [sys.executable, os.path.join(HERE, "tcp_proxy.py"), str(proxy_port), url.host, str(url.port or 5432)]

    def start_proxy():
        proc = subprocess.Popen(proxy_command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout.readline().strip() == b"listening"
        return proc

    proxy = start_proxy()
    num_jobs = 50
    try:
        env, runs = hooked
        worker = start_worker(
            **env,
            WEIR_DATABASE_URL=url.set(port=proxy_port).render_as_string(hide_password=False),
            WEIR_DB_RETRY_TIMEOUT_S="60",
            WEIR_MODEL=slow_model_dir,
        )
        batch_id = generate_batch(client, num_jobs, max_tokens=48)
        wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 8, what="8 jobs done")
        proxy.kill()  # every connection of the worker drops; new ones are refused
        proxy.wait()
        time.sleep(1)
        during = client.batch_status(batch_id).num_succeeded
        time.sleep(9)
        assert client.batch_status(batch_id).num_succeeded == during, "a result was stored without the database"
        assert during < num_jobs
        proxy = start_proxy()
        client.wait(batch_id, timeout_s=120)

        table = assert_each_succeeded_once(client, batch_id, num_jobs)
        # Nothing was acked without its result, so no message was delivered twice. A claim whose
        # COMMIT reached Postgres just as the cut hit looks failed to the worker and is retried:
        # at most one such claim per task thread (4) counts a second attempt.
        attempts = sorted(row[1] for row in table.values())
        assert set(attempts) <= {1, 2} and attempts.count(2) <= 4
        assert_runs_and_writes(client, batch_id, runs, effects, cut_short=set(table))  # runs <= starts
        assert "transient database error" in worker.log()
        assert worker.is_alive()
    finally:
        proxy.kill()
        proxy.wait()


def test_redelivery_past_a_short_visibility_timeout_runs_the_job_once(start_worker, client, worker_env,
                                                                     slow_model_dir):
    # The job runs past the visibility timeout: Redis delivers its message again while it runs.
    # The second delivery finds a live lease, and runs nothing; one transaction wrote the result
    # and the enrichment.
    hook = os.path.join(HERE, "crash_hook")
    worker = start_worker(WEIR_MODEL=slow_model_dir, WEIR_VISIBILITY_TIMEOUT_S="1", WEIR_JOB_TIMEOUT_S="30",
                          WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2", WEIR_LEASE_S="5",
                          WEIR_CANCEL_POLL_INTERVAL_S="0.5", WEIR_TEST_RUN_SLEEP_S="4",  # 4 s in its run
                          PYTHONPATH=hook + os.pathsep + worker_env["PYTHONPATH"])
    product_id = f"dup-{uuid.uuid4().hex[:8]}"
    batch_id = client.enqueue_batch([GenerateRequest(prompt="A slow one", max_tokens=480, temperature=0,
                                                     extensions={"enrichment": {"catalog": "faults", "product_id": product_id}})])
    [job] = client.jobs(batch_id)
    client.wait(batch_id, timeout_s=60)
    assert f"job {job.id}: held under another claim's live lease" in worker.log()

    table = rows(client, batch_id)
    assert list(table.values()) == [(JobStatus.SUCCEEDED, 1, worker.hostname, table["0"][3])]
    with client.session_factory() as session:
        job_xmin = session.execute(text("SELECT xmin::text FROM jobs WHERE id = :id"), {"id": job.id}).scalar_one()
        enrichment_xmin = session.execute(text("SELECT xmin::text FROM product_enrichment WHERE product_id = :p"),
                                          {"p": product_id}).scalar_one()
        enrichment = session.get(ProductEnrichment, ("faults", product_id))
    assert job_xmin == enrichment_xmin
    assert enrichment.description == table["0"][3]


def test_two_workers_share_a_queue_and_killing_one_loses_nothing(start_worker, client, slow_model_dir, hooked,
                                                                 effects):
    env, runs = hooked
    num_jobs = 40
    settings = dict(env, **FAST_REDELIVERY, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2")
    first, second = start_worker(**settings), start_worker(**settings)
    batch_id = generate_batch(client, num_jobs, max_tokens=96)  # ~0.6 s each on the slow model

    def first_is_busy():
        return (client.batch_status(batch_id).num_succeeded >= 10
                and num_just_claimed(client, batch_id, worker=first.hostname))

    wait_until(first_is_busy, what="10 done, the first worker just started a job")
    first.sigkill()
    at_kill = rows(client, batch_id)
    interrupted = {c for c, row in at_kill.items() if row[0] == JobStatus.RUNNING and row[2] == first.hostname}
    assert interrupted  # the kill caught the first worker's jobs running: the comparison below is not vacuous
    client.wait(batch_id, timeout_s=120)

    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    by_worker = {first.hostname: 0, second.hostname: 0}
    for row in table.values():
        by_worker[row[2]] += 1
    assert by_worker[first.hostname] >= 1 and by_worker[second.hostname] >= 1
    assert sum(by_worker.values()) == num_jobs
    assert {c: (row[1], row[2]) for c, row in table.items() if c in interrupted} == {
        c: (2, second.hostname) for c in interrupted}
    assert {row[1] for c, row in table.items() if c not in interrupted} == {1}
    assert_runs_and_writes(client, batch_id, runs, effects, interrupted)


def test_poison_job_fails_after_max_attempts_and_the_others_succeed(start_worker, client, slow_model_dir):
    start_worker(WEIR_MODEL=slow_model_dir, WEIR_JOB_TIMEOUT_S="0.5", WEIR_MAX_ATTEMPTS="2",
                 WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2")
    requests = [GenerateRequest(prompt=f"Item {i}", custom_id=f"good-{i}", temperature=0, max_tokens=1)
                for i in range(12)]
    # On the slow model 480 tokens take ~3 s, a 1-token job ~10 ms: the poison runs past the
    # 0.5 s job timeout on every attempt, the others well within it.
    requests.insert(3, GenerateRequest(prompt="Poison", custom_id="poison", temperature=0, max_tokens=480))
    batch_id = client.enqueue_batch(requests)

    final = client.wait(batch_id, timeout_s=120)

    table = rows(client, batch_id)
    assert (final.status, final.num_succeeded, final.num_failed) == (BatchStatus.COMPLETED, 12, 1)
    assert {c: row[:2] for c, row in table.items()} == {
        **{f"good-{i}": (JobStatus.SUCCEEDED, 1) for i in range(12)}, "poison": (JobStatus.FAILED, 2)}
    [poison] = [r for r in client.results(batch_id) if r["custom_id"] == "poison"]
    assert poison["error"] == "JobTimedOut: no result after 0.5s (WEIR_JOB_TIMEOUT_S); aborted on each of 2 attempts"
    assert poison["output_text"] is None


def test_malformed_messages_become_dead_letters_and_the_worker_goes_on(start_worker, client):
    worker = start_worker()
    app = client.celery_app
    app.send_task(names.RUN_JOB, args=["not-a-uuid"], queue=client.queue)
    app.send_task(names.RUN_JOB, args=[1, 2], queue=client.queue)
    unknown = app.send_task("weir.no_such_task", args=[], queue=client.queue)
    with app.connection_for_write() as connection:
        producer = connection.Producer()
        producer.publish({"hello": "world"}, exchange="", routing_key=client.queue, serializer="json")
        producer.publish(b"{not json", exchange="", routing_key=client.queue,
                         content_type="application/json", content_encoding="utf-8")
    # list entries kombu cannot read at all: not JSON, and a body its base64 cannot decode
    raw = redis.Redis.from_url(client.settings.worker.broker_url)
    raw.lpush(client.queue, "not json at all")
    raw.lpush(client.queue, json.dumps({
        "body": "xx", "content-encoding": "utf-8", "content-type": "application/json", "headers": {},
        "properties": {"body_encoding": "base64", "delivery_tag": "t", "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": client.queue}}}))

    # Unicode through the queue, the engine and the database, byte for byte.
    labels = ["🍵 緑茶", "صابون ‏عطري", "石鹸 🧼"]
    prompt = "Product: 抹茶 🍵 — شاي أخضر\nCategory:"
    metadata = {"名前": "👩🏽‍🔬 עברית", "rtl": "\u202eabc"}
    batch_id = client.enqueue_batch([
        ClassifyRequest(prompt=prompt, labels=labels, custom_id="🍵-1", metadata=metadata),
        GenerateRequest(prompt=prompt, custom_id="gen", max_tokens=4),
    ])
    final = client.wait(batch_id, timeout_s=60)

    assert (final.status, final.num_succeeded) == (BatchStatus.COMPLETED, 2)
    [cls, gen] = client.results(batch_id)
    assert cls["custom_id"].encode() == "🍵-1".encode() and cls["metadata"] == metadata
    assert cls["label"].encode() in [label.encode() for label in labels]
    assert sorted(cls["label_probs"]) == sorted(labels)
    with client.session_factory() as session:
        stored = session.get(Job, uuid.UUID(cls["job_id"])).request
    assert stored["prompt"].encode() == prompt.encode() and stored["labels"] == labels

    def letters():
        with client.session_factory() as session:
            return session.execute(
                select(DeadLetter.task, DeadLetter.reason).where(DeadLetter.queue == client.queue)
            ).all()

    wait_until(lambda: len(letters()) == 7, timeout_s=30, what="7 dead letters")
    assert sorted(letters(), key=lambda r: r.reason) == sorted([
        (names.RUN_JOB, "job id 'not-a-uuid' is not a UUID"),
        (names.RUN_JOB, "run_job takes args [job_id], got args [1, 2] kwargs {}"),
        ("weir.no_such_task", "unknown task 'weir.no_such_task'"),
        (None, "not a task message"),
        (None, "cannot decode the message body: " + _decode_error_reason(worker.log())),
        (None, "not a readable message: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
        (None, "not a readable message: Error: Incorrect padding"),
    ], key=lambda r: r[1])
    assert unknown.id in worker.log() and worker.is_alive()


def _decode_error_reason(log: str) -> str:
    marker = "cannot decode the message body: "
    line = next(line for line in log.splitlines() if marker in line)
    return line.split(marker, 1)[1].strip()


def test_cancel_aborts_a_running_job_and_skips_queued_ones(start_worker, client, slow_model_dir):
    worker = start_worker(WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="1", WEIR_MAX_NUM_SEQS="1",
                          WEIR_CANCEL_POLL_INTERVAL_S="0.1")
    batch_id = client.enqueue_batch([
        GenerateRequest(prompt="Long", custom_id="long", temperature=0, max_tokens=480),
        GenerateRequest(prompt="Next", custom_id="next", temperature=0, max_tokens=4),
    ])
    wait_until(lambda: rows(client, batch_id)["long"][0] == JobStatus.RUNNING, what="the long job running")
    progress = client.cancel(batch_id)
    assert (progress.status, progress.num_cancelled) == (BatchStatus.CANCELLED, 2)
    [long_job, next_job] = client.jobs(batch_id)
    wait_until(lambda: f"job {long_job.id}: cancelled or lease lost while running" in worker.log(), timeout_s=10,
               what="the abort")
    wait_until(lambda: f"job {next_job.id}: nothing to run" in worker.log(), timeout_s=10, what="the skip")

    table = rows(client, batch_id)
    assert {c: row[:2] + (row[3],) for c, row in table.items()} == {
        "long": (JobStatus.CANCELLED, 1, None), "next": (JobStatus.CANCELLED, 0, None)}
    assert worker.terminate() == 0


def test_a_job_that_crashes_the_worker_every_time_fails_after_max_attempts(worker_env, start_worker, client, tmp_path):
    hook = os.path.join(HERE, "crash_hook")
    settings = dict(FAST_REDELIVERY, WEIR_MAX_ATTEMPTS="2", WEIR_CONCURRENCY="1", WEIR_MAX_NUM_SEQS="1",
                    WEIR_TEST_CRASH_MARKER="CRASH-ME", PYTHONPATH=hook + os.pathsep + worker_env["PYTHONPATH"])
    requests = [GenerateRequest(prompt="CRASH-ME", custom_id="poison", max_tokens=2)]
    requests += [GenerateRequest(prompt=f"Item {i}", custom_id=f"good-{i}", max_tokens=2) for i in range(6)]
    batch_id = client.enqueue_batch(requests)
    worker = start_worker(**settings)
    num_restarts = 0
    deadline = time.monotonic() + 120
    while not client.batch_status(batch_id).status.is_finished:
        assert time.monotonic() < deadline, "batch not finished after 120 s"
        if not worker.is_alive():  # what a process supervisor does
            worker = start_worker(**settings)
            num_restarts += 1
        time.sleep(0.1)

    table = rows(client, batch_id)
    assert num_restarts == 2  # one crash per attempt; the third delivery only records the failure
    assert {c: row[:2] for c, row in table.items()} == {
        "poison": (JobStatus.FAILED, 2), **{f"good-{i}": (JobStatus.SUCCEEDED, 1) for i in range(6)}}
    [poison] = [r for r in client.results(batch_id) if r["custom_id"] == "poison"]
    assert poison["error"] == "gave up after 2 attempts: each one lost its worker or ran out of time"
