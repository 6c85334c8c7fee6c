"""The pipeline's guarantees under load and faults, against real ``weir worker`` processes, real
Redis and real Postgres, counting effects rather than rows: engine runs per job (each
``WorkerRuntime.run``, logged by the test hook in ``crash_hook/``), and result and enrichment
writes per job (counted by triggers the ``effects`` fixture of ``conftest.py`` installs in the
test database; the primary key keeps one row per job whatever happens, so a row count proves
nothing)."""

import os
import re
import signal
import time
import uuid

import pytest

from weir.jobs import names
from weir.jobs.claims import ClaimStatus, claim_jobs
from weir.jobs.db import BatchStatus, JobStatus
from weir.jobs.schemas import GenerateRequest

from tests.worker.test_faults import HERE, assert_each_succeeded_once, rows, wait_until, with_status

pytestmark = pytest.mark.integration


def enqueue(client, num_jobs, max_tokens, prefix="job", product_prefix=None):
    product_prefix = product_prefix or f"p-{uuid.uuid4().hex[:8]}"
    return client.enqueue_batch([
        GenerateRequest(prompt=f"Product number {i}", custom_id=f"{prefix}-{i}", temperature=0,
                        max_tokens=max_tokens, extensions={"enrichment": {"catalog": "pipeline", "product_id": f"{product_prefix}-{i}"}})
        for i in range(num_jobs)
    ]), product_prefix


def job_ids(client, batch_id):
    return {job.custom_id: job.id for job in client.jobs(batch_id)}


def test_a_tiny_pool_under_many_threads_fails_no_job(start_worker, client, hooked, effects):
    env, runs = hooked
    num_jobs = 60
    # 16 task threads, one pooled connection (+1 overflow) and a 1 ms pool wait: the two group
    # writers and the lease renewer (every 20 ms) contend for them, and pool waits time out.
    worker = start_worker(**env, WEIR_CONCURRENCY="16", WEIR_MAX_NUM_SEQS="16", WEIR_POOL_SIZE="1",
                          WEIR_POOL_TIMEOUT_S="0.001", WEIR_CANCEL_POLL_INTERVAL_S="0.02", WEIR_LEASE_S="5")
    batch_id, products = enqueue(client, num_jobs, max_tokens=4)
    client.wait(batch_id, timeout_s=180)
    log = worker.log()
    assert "QueuePool limit" in log  # pool waits did time out
    assert "unexpected error" not in log  # and each was retried as transient, not as a task error

    assert_each_succeeded_once(client, batch_id, num_jobs)
    ids = job_ids(client, batch_id)
    assert set(runs()) >= {str(i) for i in ids.values()}
    assert {runs()[str(i)] for i in ids.values()} == {1}  # one engine run per job
    assert set(effects("jobs", ids.values()).values()) == {1}  # one result write per job
    assert set(effects("product_enrichment", [f"{products}-{i}" for i in range(num_jobs)]).values()) == {1}


def test_a_failed_engine_step_requeues_its_jobs_and_each_succeeds_once(start_worker, client, hooked, effects):
    env, runs = hooked
    num_jobs = 12
    worker = start_worker(**env, WEIR_TEST_STEP_FAILURES="1")
    batch_id, products = enqueue(client, num_jobs, max_tokens=8)
    client.wait(batch_id, timeout_s=120)

    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    ids = job_ids(client, batch_id)
    counted = runs()
    requeued = {c for c, i in ids.items() if counted[str(i)] == 2}
    assert requeued, "the failed step had jobs in flight"
    assert {counted[str(i)] for c, i in ids.items() if c not in requeued} == {1}
    # The failed start was the engine's fault, not the job's: it is given back.
    assert {c: row[1] for c, row in table.items()} == {c: 1 for c in table}
    assert set(effects("jobs", ids.values()).values()) == {1}
    assert set(effects("product_enrichment", [f"{products}-{i}" for i in range(num_jobs)]).values()) == {1}
    assert "engine step failed (1 in a row)" in worker.log()
    assert worker.is_alive()


def test_a_sticky_engine_failure_makes_the_worker_exit_and_another_drains_the_queue(start_worker, client, hooked,
                                                                                     effects):
    env, runs = hooked
    num_jobs = 10
    broken = start_worker(**env, WEIR_TEST_STEP_FAILURES="always", WEIR_MAX_ENGINE_FAILURES="3")
    batch_id, products = enqueue(client, num_jobs, max_tokens=8)
    assert broken.proc.wait(60) == 70  # EX_SOFTWARE: the supervisor restarts it
    # at least the limit: the engine core may fail another step before the worker reads the third
    failed = re.search(r"engine failed (\d+) steps in a row", broken.log())
    assert failed and int(failed.group(1)) >= 3
    at_exit = rows(client, batch_id)
    assert with_status(at_exit, JobStatus.RUNNING) == set()  # every lease was given back

    start_worker(**env)
    client.wait(batch_id, timeout_s=120)
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert {c: row[1] for c, row in table.items()} == {c: 1 for c in table}
    ids = job_ids(client, batch_id)
    assert set(effects("jobs", ids.values()).values()) == {1}
    assert set(effects("product_enrichment", [f"{products}-{i}" for i in range(num_jobs)]).values()) == {1}


def engine_core_pid(worker) -> int:
    """The pid of the worker's engine core process: its child named ``weir-engine``."""
    from weir.engine.core import PROCESS_NAME

    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name == PROCESS_NAME and int(rest[1]) == worker.proc.pid:  # rest[1]: the parent's pid
            found.append(int(entry))
    assert len(found) == 1, f"the worker has {len(found)} engine core processes"
    return found[0]


def test_a_killed_engine_core_gives_its_jobs_back_the_worker_exits_70_and_another_drains(
        start_worker, client, hooked, effects, slow_model_dir):
    env, runs = hooked
    num_jobs = 6
    worker = start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="4", WEIR_MAX_NUM_SEQS="4")
    batch_id, products = enqueue(client, num_jobs, max_tokens=400)  # ~2.5 s each on the slow model
    ids = job_ids(client, batch_id)
    wait_until(lambda: len(runs()) >= 2, timeout_s=60, what="jobs in the engine")
    interrupted = set(runs())
    os.kill(engine_core_pid(worker), signal.SIGKILL)
    assert worker.proc.wait(60) == 70  # EX_SOFTWARE, as for a failing engine
    assert "the engine core process died: it exited with status -9" in worker.log()
    at_exit = rows(client, batch_id)
    assert with_status(at_exit, JobStatus.RUNNING) == set()  # every lease was given back
    assert with_status(at_exit, JobStatus.FAILED) == set()  # not the jobs' fault

    start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="4", WEIR_MAX_NUM_SEQS="4")
    client.wait(batch_id, timeout_s=180)
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert {c: row[1] for c, row in table.items()} == {c: 1 for c in table}  # the failed start was given back
    counted = runs()
    assert interrupted and {counted[i] for i in interrupted} == {2}  # the interrupted ran again, once
    assert set(effects("jobs", ids.values()).values()) == {1}
    assert set(effects("product_enrichment", [f"{products}-{i}" for i in range(num_jobs)]).values()) == {1}


def test_a_duplicate_delivery_while_the_job_runs_starts_no_second_run(start_worker, client, hooked, effects,
                                                                      slow_model_dir):
    env, runs = hooked
    worker = start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2",
                          WEIR_LEASE_S="5", WEIR_CANCEL_POLL_INTERVAL_S="0.5")
    batch_id, products = enqueue(client, 1, max_tokens=400)  # ~2.5 s on the slow model
    [job_id] = job_ids(client, batch_id).values()
    wait_until(lambda: runs()[str(job_id)] == 1, timeout_s=30, what="the run")
    client.celery_app.send_task(names.RUN_JOB, args=[str(job_id)], queue=client.queue)  # the duplicate
    client.wait(batch_id, timeout_s=60)
    # the duplicate found the live lease, came back once it would have expired, and found the job done
    wait_until(lambda: f"job {job_id}: nothing to run" in worker.log(), timeout_s=30, what="the duplicate's end")
    assert f"job {job_id}: held under another claim's live lease" in worker.log()

    assert_each_succeeded_once(client, batch_id, 1)
    assert runs()[str(job_id)] == 1
    assert effects("jobs", [job_id]) == {str(job_id): 1}
    assert effects("product_enrichment", [f"{products}-0"]) == {f"{products}-0": 1}


def test_a_late_success_after_a_give_up_changes_nothing(start_worker, client, hooked, effects, slow_model_dir):
    env, runs = hooked
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="1", WEIR_MAX_NUM_SEQS="1",
                    WEIR_MAX_ATTEMPTS="1", WEIR_LEASE_S="2", WEIR_CANCEL_POLL_INTERVAL_S="0.5")
    frozen = start_worker(**settings)
    batch_id, products = enqueue(client, 1, max_tokens=300)
    [job_id] = job_ids(client, batch_id).values()
    wait_until(lambda: runs()[str(job_id)] == 1, timeout_s=30, what="the run")
    frozen.proc.send_signal(signal.SIGSTOP)  # alive but silent: its lease runs out
    try:
        time.sleep(3)
        with client.session_factory.begin() as session:  # what a sweep or a redelivery does next
            claims = claim_jobs(session, [job_id], worker="other", lease_s=60, max_attempts=1)
        assert claims[job_id].status == ClaimStatus.GAVE_UP
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: "result dropped" in frozen.log() or "cancelled or lease lost" in frozen.log(),
               timeout_s=60, what="the late attempt's end")

    final = client.batch_status(batch_id)
    [result] = client.results(batch_id)
    assert (result["status"], result["output_text"]) == ("failed", None)
    assert result["error"] == "gave up after 1 attempts: each one lost its worker or ran out of time"
    assert (final.status, final.num_failed, final.num_succeeded) == (BatchStatus.FAILED, 1, 0)
    assert effects("jobs", [job_id]) == {str(job_id): 1}
    assert effects("product_enrichment", [f"{products}-0"]) == {f"{products}-0": 0}


def test_a_postgres_that_stops_answering_is_given_up_on_within_the_budget_and_nothing_is_lost(
        start_worker, client, hooked, effects, worker_env, slow_model_dir):
    import subprocess
    import sys

    from sqlalchemy import make_url

    from tests.worker.test_faults import free_port

    env, runs = hooked
    proxy_port = free_port()
    url = make_url(worker_env["WEIR_DATABASE_URL"])
    proxy = subprocess.Popen([sys.executable, os.path.join(HERE, "tcp_proxy.py"), str(proxy_port), url.host,
                              str(url.port or 5432)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proxy.stdout.readline().strip() == b"listening"
    num_jobs = 40
    try:
        # Budget: a silent database fails a call after WEIR_STATEMENT_TIMEOUT_S + 5 s (the
        # watchdog) or WEIR_CONNECT_TIMEOUT_S; calls are retried for WEIR_DB_RETRY_TIMEOUT_S.
        worker = start_worker(**env, WEIR_DATABASE_URL=url.set(port=proxy_port).render_as_string(hide_password=False),
                              WEIR_STATEMENT_TIMEOUT_S="1", WEIR_CONNECT_TIMEOUT_S="2", WEIR_DB_RETRY_TIMEOUT_S="120",
                              WEIR_MODEL=slow_model_dir, WEIR_LEASE_S="60")
        batch_id, products = enqueue(client, num_jobs, max_tokens=48)
        wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 8, what="8 jobs done")
        proxy.send_signal(signal.SIGUSR1)  # a black hole: connections stay open, nothing answers
        time.sleep(1)
        during = client.batch_status(batch_id).num_succeeded
        time.sleep(10)
        assert client.batch_status(batch_id).num_succeeded == during, "a result was stored without the database"
        assert during < num_jobs
        proxy.send_signal(signal.SIGUSR2)
        started = time.monotonic()
        client.wait(batch_id, timeout_s=120)
        recovered_s = time.monotonic() - started

        assert_each_succeeded_once(client, batch_id, num_jobs)
        ids = job_ids(client, batch_id)
        assert {runs()[str(i)] for i in ids.values()} == {1}  # the engine's results waited in memory
        assert set(effects("jobs", ids.values()).values()) == {1}
        assert set(effects("product_enrichment", [f"{products}-{i}" for i in range(num_jobs)]).values()) == {1}
        log = worker.log()
        assert "transient database error" in log and worker.is_alive()
        assert recovered_s < 60, f"{recovered_s:.0f}s to drain after the database came back"
    finally:
        proxy.kill()
        proxy.wait()


def test_a_message_deleted_from_a_50000_job_backlog_is_recovered_and_the_backlog_is_not_republished(
        start_worker, client, hooked, redis_url, queue):
    import redis as redis_lib
    from sqlalchemy import func, select

    from weir.jobs.db import Job

    env, runs = hooked
    # the grace covers a message a worker has taken and not yet claimed: a few seconds on a
    # loaded 2-core CI machine
    num_jobs, lost_index, grace_s = 50_000, 49, 5.0
    batch_id = client.enqueue_batch(GenerateRequest(prompt=f"Item {i}", custom_id=f"job-{i}", max_tokens=1)
                                    for i in range(num_jobs))
    r = redis_lib.Redis.from_url(redis_url)
    queue = names.interactive_queue(queue)  # where a priority-0 batch's messages wait
    assert r.llen(queue) == num_jobs
    lost_message = r.lindex(queue, -1 - lost_index)  # the 50th oldest: gone from Redis
    assert r.lrem(queue, 1, lost_message) == 1
    with client.session_factory() as session:
        lost_id = session.scalar(select(Job.id).where(Job.batch_id == batch_id, Job.batch_index == lost_index))
    republished = client.sweep(older_than_s=grace_s)  # nothing is lost before the queue reaches it
    assert republished == 0
    lost_published = client.jobs(batch_id)[-1].published_at

    start_worker(**env, WEIR_CONCURRENCY="8", WEIR_MAX_NUM_SEQS="8")
    deadline = time.monotonic() + 120
    while runs()[str(lost_id)] == 0:  # what beat does every WEIR_SWEEP_INTERVAL_S (here 0.5 s)
        assert time.monotonic() < deadline, "the lost job was not recovered"
        republished += client.sweep(older_than_s=grace_s)
        time.sleep(0.5)
    waiting = r.llen(queue)
    client.cancel(batch_id)

    assert republished == 1, [  # the lost one, and not one message of the backlog
        (j.batch_index, j.status, j.attempts) for j in client.jobs(batch_id) if j.published_at > lost_published]
    assert waiting > num_jobs - 5_000  # recovered while the backlog waits
    with client.session_factory() as session:
        neighbours = session.scalar(select(func.max(Job.started_at)).where(
            Job.batch_id == batch_id, Job.batch_index <= lost_index + 1, Job.id != lost_id))
        lost = session.get(Job, lost_id)
    # Bound: WEIR_SWEEP_INTERVAL_S + WEIR_SWEEP_AFTER_S after the queue reached it (its new
    # message goes to the control queue, ahead of the backlog), plus a second of slack.
    late_s = (lost.started_at - neighbours).total_seconds()
    assert lost.attempts == 1 and late_s < 0.5 + grace_s + 1.0, late_s
