"""Bulk batches travel in chunks (``run_chunk``: many job ids to a message), against real
``weir worker`` processes, Redis and Postgres; engine runs and result writes counted per job."""

import os
import signal
import time

import pytest
import redis
from sqlalchemy import select

from weir.jobs import names
from weir.jobs.db import BatchStatus, Job, JobStatus
from weir.jobs.schemas import BULK_PRIORITY, GenerateRequest

from tests.worker.test_faults import FAST_REDELIVERY, assert_each_succeeded_once, rows, wait_until, with_status

pytestmark = pytest.mark.integration

CHUNK = 8


@pytest.fixture
def client(worker_env):
    """A producer that publishes bulk batches as chunks of :data:`CHUNK` jobs."""
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings
    from weir.jobs.client import Client

    client = Client(Settings(
        engine=EngineSettings(model=worker_env["WEIR_MODEL"]),
        worker=WorkerSettings(broker_url=worker_env["WEIR_BROKER_URL"], queue=worker_env["WEIR_QUEUE"],
                              bulk_chunk_size=CHUNK),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"]),
    ))
    yield client
    client.close()


def bulk(client, num_jobs, max_tokens, prompt=lambda i: f"Product number {i}"):
    return client.enqueue_batch([
        GenerateRequest(prompt=prompt(i), custom_id=f"job-{i}", temperature=0, max_tokens=max_tokens)
        for i in range(num_jobs)], priority=BULK_PRIORITY)


def messages(client, queue):
    """(task name, number of job ids) of every message waiting in ``queue``."""
    import json

    raw = redis.Redis.from_url(client.settings.worker.broker_url)
    found = []
    for key in [queue, *raw.keys(f"{queue}\x06\x16*")]:
        if raw.type(key) != b"list":
            continue
        for entry in raw.lrange(key, 0, -1):
            envelope = json.loads(entry)
            import base64

            body = json.loads(base64.b64decode(envelope["body"]))
            found.append((envelope["headers"]["task"], len(body[0])))
    return found


def sweep_until_finished(client, batch_id, timeout_s, what):
    """Sweep (1 s grace) every 0.5 s, as beat does, until the batch is finished; returns how many
    jobs the sweeps published again. Fails with ``what`` after ``timeout_s``."""
    republished = 0
    deadline = time.monotonic() + timeout_s
    while not client.batch_status(batch_id).status.is_finished:
        assert time.monotonic() < deadline, what
        republished += client.sweep(older_than_s=1)
        time.sleep(0.5)
    return republished


def test_a_bulk_batch_is_published_in_chunks_and_an_interactive_one_per_job(client):
    bulk(client, 20, max_tokens=1)
    client.enqueue_batch([GenerateRequest(prompt="Hello", max_tokens=1)] * 3)
    assert sorted(messages(client, names.bulk_queue(client.queue))) == [
        (names.RUN_CHUNK, 4), (names.RUN_CHUNK, 8), (names.RUN_CHUNK, 8)]
    assert messages(client, names.interactive_queue(client.queue)) == [(names.RUN_JOB, 1)] * 3
    assert messages(client, client.queue) == []
    assert client.num_waiting_messages() == 6


def test_an_interactive_job_runs_while_bulk_chunks_fill_the_bulk_window(start_worker, client, hooked,
                                                                        slow_model_dir):
    env, runs = hooked
    # one message in the bulk window (WEIR_CONCURRENCY 1): a chunk holds it until its 8 jobs are stored
    start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="1", WEIR_INTERACTIVE_CONCURRENCY="1",
                 WEIR_MAX_NUM_SEQS="2", WEIR_SCHEDULING_POLICY="priority")
    batch_id = bulk(client, 3 * CHUNK, max_tokens=64)  # ~0.4 s a job on the slow model
    wait_until(lambda: len(runs()) >= 1, what="bulk jobs in the engine")
    probe = client.enqueue_batch([GenerateRequest(prompt="Hello", max_tokens=1)])
    client.wait(probe, timeout_s=60)
    client.wait(batch_id, timeout_s=120)
    assert_each_succeeded_once(client, batch_id, 3 * CHUNK)
    with client.session_factory() as session:
        bulk_done = sorted(session.scalars(select(Job.finished_at).where(Job.batch_id == batch_id)))
        probe_done = session.scalar(select(Job.finished_at).where(Job.batch_id == probe))
    # the probe neither waited for the first chunk's message to be acked nor for its jobs
    assert probe_done < bulk_done[CHUNK - 1]


def test_a_worker_holds_only_the_chunks_its_engine_runs_and_the_rest_wait_in_the_broker(
        start_worker, client, hooked, effects, slow_model_dir):
    env, runs = hooked
    # 2 sequences: 4 places in the engine, one chunk of 8 fills them; the window is that chunk and
    # one more, although the model queue's window and chunk threads would allow 8 and 4
    start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="8", WEIR_MAX_NUM_SEQS="2")
    num_chunks = 8
    batch_id = bulk(client, num_chunks * CHUNK, max_tokens=16)  # ~0.1 s a job on the slow model
    r = redis.Redis.from_url(client.settings.worker.broker_url)
    bulk_lists = [names.bulk_queue(client.queue), *r.keys(f"{names.bulk_queue(client.queue)}\x06\x16*")]
    held, waiting = [], []  # messages the worker holds (kombu's unacked hash), chunks left in Redis
    while not client.batch_status(batch_id).status.is_finished:
        held.append(r.hlen(f"{client.queue}.unacked"))
        waiting.append(sum(r.llen(key) for key in bulk_lists))
        time.sleep(0.02)
    assert max(held) == 2, held
    assert max(waiting) >= num_chunks - 2 and waiting[-1] == 0, waiting
    assert_each_succeeded_once(client, batch_id, num_chunks * CHUNK)
    ids = [j.id for j in client.jobs(batch_id)]
    assert set(runs()[str(i)] for i in ids) == {1}
    assert set(effects("jobs", ids).values()) == {1}


def test_every_job_of_a_chunked_batch_runs_once_and_is_stored_once(start_worker, client, hooked, effects):
    env, runs = hooked
    num_jobs = 50
    start_worker(**env)
    batch_id = bulk(client, num_jobs, max_tokens=4)
    client.wait(batch_id, timeout_s=120)
    assert_each_succeeded_once(client, batch_id, num_jobs)
    ids = [j.id for j in client.jobs(batch_id)]
    assert set(runs()[str(i)] for i in ids) == {1}
    assert set(effects("jobs", ids).values()) == {1}


def test_sigkill_mid_chunk_runs_only_the_unfinished_jobs_again(start_worker, client, hooked, effects,
                                                               slow_model_dir):
    env, runs = hooked
    num_jobs = 24
    # a 5 s lease: the killed worker's jobs are claimed again 5 s after the kill, not 30
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_VISIBILITY_TIMEOUT_S="6", WEIR_CONCURRENCY="2",
                    WEIR_MAX_NUM_SEQS="4", WEIR_LEASE_S="5", WEIR_CANCEL_POLL_INTERVAL_S="0.5")
    worker = start_worker(**settings)
    batch_id = bulk(client, num_jobs, max_tokens=64)  # ~0.4 s each on the slow model
    wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 4, what="4 jobs done")
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(10)
    at_kill = rows(client, batch_id)
    finished = with_status(at_kill, JobStatus.SUCCEEDED)
    interrupted = with_status(at_kill, JobStatus.RUNNING)
    assert finished and interrupted  # the kill caught a chunk part done

    start_worker(**settings)
    client.wait(batch_id, timeout_s=180)
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    ids = {j.custom_id: str(j.id) for j in client.jobs(batch_id)}
    counted = runs()
    assert {counted[ids[c]] for c in finished} == {1}  # stored before the kill: never run again
    assert {c: (counted[ids[c]], table[c][1]) for c in table if counted[ids[c]] > table[c][1]} == {}  # engine runs per job <= attempts
    assert {counted[ids[c]] for c in interrupted} <= {1, 2}
    assert set(effects("jobs", ids.values()).values()) == {1}


def test_sigterm_past_the_grace_period_mid_chunk_puts_the_chunk_back_and_a_restart_finishes_it(
        start_worker, client, hooked, effects, slow_model_dir):
    """Warm shutdown with a 0.2 s grace period while a chunk's jobs run: the jobs in the engine are
    aborted and their leases given back (their start counted), the chunk's other claimed jobs
    given back uncounted, the message requeued; the worker exits 0 within seconds. After a
    restart each job has succeeded, was written once, and ran again only if the shutdown cut it
    short."""
    from tests.worker.test_faults import assert_runs_and_writes

    env, runs = hooked
    num_jobs = 2 * CHUNK
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="1", WEIR_MAX_NUM_SEQS="4",
                    WEIR_SHUTDOWN_TIMEOUT_S="0.2")
    worker = start_worker(**settings)
    batch_id = bulk(client, num_jobs, max_tokens=240)  # ~1.5 s each on the slow model
    wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 1 and len(runs()) > 4,
               what="a job done and its successor in the engine")
    started = time.monotonic()
    assert worker.terminate(timeout_s=60) == 0
    shutdown_s = time.monotonic() - started

    stopped = rows(client, batch_id)
    ran = {j.custom_id for j in client.jobs(batch_id) if runs()[str(j.id)]}
    put_back = {c for c, row in stopped.items() if row[0] == JobStatus.QUEUED and row[1] == 1}
    assert with_status(stopped, JobStatus.RUNNING) == set()  # every lease given back
    assert put_back and put_back == ran - with_status(stopped, JobStatus.SUCCEEDED)
    assert {row[1] for c, row in stopped.items() if row[0] == JobStatus.QUEUED and c not in put_back} <= {0}
    assert shutdown_s < 10, f"warm shutdown took {shutdown_s:.1f}s with a 0.2 s grace period"
    assert "shutdown grace period over:" in worker.log()

    start_worker(**env, WEIR_MODEL=slow_model_dir)
    client.wait(batch_id, timeout_s=180)
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert {c: row[1] for c, row in table.items()} == {c: 2 if c in put_back else 1 for c in table}
    assert_runs_and_writes(client, batch_id, runs, effects, put_back)
    assert {c for c, n in ((j.custom_id, runs()[str(j.id)]) for j in client.jobs(batch_id)) if n == 2} == put_back


def test_a_poison_job_inside_a_chunk_fails_alone_and_the_others_succeed(start_worker, client, hooked):
    env, runs = hooked
    # leases shorter than the visibility timeout: when the chunk comes back, the dead worker's
    # leases have expired, so each job published alone is claimed at once, one at a time (a job
    # still held would wait as an ETA retry, which runs beside others whatever WEIR_CONCURRENCY says)
    settings = {**env, **FAST_REDELIVERY, "WEIR_TEST_CRASH_MARKER": "CRASH-ME", "WEIR_MAX_ATTEMPTS": "2",
                "WEIR_CONCURRENCY": "1", "WEIR_MAX_NUM_SEQS": "1", "WEIR_LEASE_S": "3"}
    num_jobs = 8
    batch_id = bulk(client, num_jobs, max_tokens=2, prompt=lambda i: "CRASH-ME" if i == 3 else f"Item {i}")
    worker = start_worker(**settings)
    num_restarts = 0
    deadline = time.monotonic() + 150
    while not client.batch_status(batch_id).status.is_finished:
        assert time.monotonic() < deadline, "batch not finished after 150 s"
        if not worker.is_alive():  # what a process supervisor does
            worker = start_worker(**settings)
            num_restarts += 1
        time.sleep(0.1)

    table = rows(client, batch_id)
    assert num_restarts == 2  # one crash per attempt of the poison job
    # the chunk's first delivery charged every claimed job a start; after the crash each
    # unfinished job ran alone, so the poison job crashed only its own second attempt
    assert table["job-3"][:2] == (JobStatus.FAILED, 2)
    assert with_status(table, JobStatus.SUCCEEDED) == {f"job-{i}" for i in range(num_jobs) if i != 3}
    ids = {j.custom_id: str(j.id) for j in client.jobs(batch_id)}
    assert all(runs()[ids[c]] <= table[c][1] for c in table)


def test_cancel_mid_chunk_aborts_the_running_jobs_and_runs_no_more(start_worker, client, hooked, slow_model_dir):
    env, runs = hooked
    num_jobs = 16
    # cancel noticed within 0.2 s; a job takes ~3 s on the slow model
    worker = start_worker(**env, WEIR_MODEL=slow_model_dir, WEIR_CANCEL_POLL_INTERVAL_S="0.2", WEIR_CONCURRENCY="2",
                          WEIR_MAX_NUM_SEQS="2")
    batch_id = bulk(client, num_jobs, max_tokens=480)
    wait_until(lambda: len(runs()) >= 2, what="jobs in the engine")
    at_cancel = dict(runs())
    client.cancel(batch_id)
    final = client.wait(batch_id, timeout_s=60)
    assert (final.status, final.num_cancelled, final.num_succeeded) == (BatchStatus.CANCELLED, num_jobs, 0)
    # both chunks end (their messages acked; one thread of two runs chunks, so the second waited),
    # and no job runs after the cancel
    try:
        wait_until(lambda: worker.log().count(f"chunk of {CHUNK} jobs: ") >= 2, timeout_s=30, what="both chunks to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the worker's log ends:\n{worker.log()[-6000:]}") from None
    assert f"chunk of {CHUNK} jobs: {CHUNK} cancelled or lease lost" in worker.log()
    assert dict(runs()) == at_cancel
    assert with_status(rows(client, batch_id), JobStatus.CANCELLED) == {f"job-{i}" for i in range(num_jobs)}


def test_a_chunk_message_lost_before_any_claim_is_recovered_by_the_sweeper(start_worker, client, hooked, effects):
    env, runs = hooked
    num_jobs = 3 * CHUNK
    batch_id = bulk(client, num_jobs, max_tokens=1)
    r = redis.Redis.from_url(client.settings.worker.broker_url)
    priority_list = [k for k in r.keys(f"{names.bulk_queue(client.queue)}\x06\x16*") if r.llen(k)][0]
    assert r.llen(priority_list) == 3
    r.rpop(priority_list)  # the oldest chunk's message is gone
    grace_s = 1.0
    start_worker(**env)
    deadline = time.monotonic() + 60
    republished = 0
    while not client.batch_status(batch_id).status.is_finished:  # what beat does
        assert time.monotonic() < deadline, "the lost chunk's jobs were not recovered"
        republished += client.sweep(older_than_s=grace_s)
        time.sleep(0.5)
    assert republished >= CHUNK  # the sweep is per model: other batches' lost jobs count too
    # the sweeper stamps what it publishes again: exactly the lost chunk's jobs (the oldest message)
    with client.session_factory() as session:
        stamps = dict(session.execute(select(Job.custom_id, Job.published_at).where(Job.batch_id == batch_id)).all())
    first = min(stamps.values())
    assert {c for c, t in stamps.items() if t != first} == {f"job-{i}" for i in range(CHUNK)}
    assert_each_succeeded_once(client, batch_id, num_jobs)
    ids = [j.id for j in client.jobs(batch_id)]
    assert set(runs()[str(i)] for i in ids) == {1}
    assert set(effects("jobs", ids).values()) == {1}


def test_a_killed_engine_core_mid_chunk_gives_the_jobs_back_and_another_worker_drains(
        start_worker, client, hooked, effects, slow_model_dir):
    from tests.worker.test_pipeline_faults import engine_core_pid

    env, runs = hooked
    num_jobs = 2 * CHUNK
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="4")
    worker = start_worker(**settings)
    batch_id = bulk(client, num_jobs, max_tokens=400)  # ~2.5 s each on the slow model
    wait_until(lambda: len(runs()) >= 4, what="jobs in the engine")
    os.kill(engine_core_pid(worker), signal.SIGKILL)
    assert worker.proc.wait(60) == 70
    at_exit = rows(client, batch_id)
    assert with_status(at_exit, JobStatus.RUNNING) == set()  # every lease was given back
    assert {row[1] for row in at_exit.values()} == {0}  # and no start counted: not the jobs' fault
    interrupted = set(runs())
    assert interrupted

    start_worker(**settings)
    client.wait(batch_id, timeout_s=180)
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert {row[1] for row in table.values()} == {1}
    counted = runs()
    assert {counted[i] for i in interrupted} == {2}
    ids = [j.id for j in client.jobs(batch_id)]
    assert set(effects("jobs", ids).values()) == {1}


@pytest.mark.parametrize("lane", ["interactive", "bulk chunks"])
def test_a_killed_worker_whose_messages_are_never_redelivered_is_recovered_by_the_lease_sweep(
        start_worker, client, hooked, effects, slow_model_dir, lane):
    """A worker SIGKILLed with jobs ``running``, its messages held in Redis' unacked hash for the
    whole visibility timeout (an hour): no redelivery brings them back. The sweeper's expired-lease
    path does (and, for a chunk's unclaimed jobs, its queue-moved-past path); every job succeeds
    once, engine runs per job at most its attempts."""
    env, runs = hooked
    num_jobs = 16
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_LEASE_S="3", WEIR_CANCEL_POLL_INTERVAL_S="0.5",
                    WEIR_CONCURRENCY="2", WEIR_INTERACTIVE_CONCURRENCY="2", WEIR_MAX_NUM_SEQS="2")
    worker = start_worker(**settings)
    requests = [GenerateRequest(prompt=f"Product number {i}", custom_id=f"job-{i}", temperature=0, max_tokens=64)
                for i in range(num_jobs)]
    batch_id = client.enqueue_batch(requests, priority=BULK_PRIORITY if lane == "bulk chunks" else None)
    wait_until(lambda: client.batch_status(batch_id).num_succeeded >= 2
               and with_status(rows(client, batch_id), JobStatus.RUNNING), what="2 jobs done and more running")
    os.kill(worker.proc.pid, signal.SIGKILL)  # a job takes ~0.4 s: the running ones are still running
    worker.proc.wait(10)
    interrupted = with_status(rows(client, batch_id), JobStatus.RUNNING)
    assert interrupted  # the kill caught jobs running

    start_worker(**settings)
    republished = sweep_until_finished(client, batch_id, 150, "the killed worker's jobs were not recovered")
    table = assert_each_succeeded_once(client, batch_id, num_jobs)
    assert republished >= len(interrupted)
    ids = {j.custom_id: str(j.id) for j in client.jobs(batch_id)}
    counted = runs()
    assert {c: (counted[ids[c]], table[c][1]) for c in table if counted[ids[c]] > table[c][1]} == {}
    assert set(effects("jobs", ids.values()).values()) == {1}


@pytest.mark.parametrize("lane", ["interactive", "bulk chunks"])
def test_a_frozen_owner_whose_job_another_worker_reclaimed_writes_nothing(start_worker, client, hooked, effects,
                                                                          slow_model_dir, lane):
    """Worker A is frozen (SIGSTOP) with a job in flight; its engine core, not frozen, finishes the
    generation. A's lease runs out (set in the past, as a long freeze would), the sweeper
    publishes the job again, and worker B claims it (a new fencing token) and is still running it
    when A wakes and writes its result: a write the job's ``running`` status does not stop, and
    the token does. B's result is the one stored, and the only result write."""
    import datetime

    from sqlalchemy import update

    from weir.jobs.db import utcnow

    from tests.worker.test_pipeline_faults import enqueue

    env, runs = hooked
    # A's lease renewer ticks every 60 s from its start: it cannot notice the lost lease before A
    # writes, so the write itself meets the fence.
    settings = dict(env, WEIR_MODEL=slow_model_dir, WEIR_CONCURRENCY="1", WEIR_INTERACTIVE_CONCURRENCY="1",
                    WEIR_MAX_NUM_SEQS="1", WEIR_LEASE_S="150", WEIR_CANCEL_POLL_INTERVAL_S="60")
    first = start_worker(**settings)
    if lane == "bulk chunks":
        batch_id = bulk(client, 1, max_tokens=400)
        products = None
    else:
        batch_id, products = enqueue(client, 1, max_tokens=400)  # ~2.5 s on the slow model
    [job_id] = [j.id for j in client.jobs(batch_id)]
    wait_until(lambda: runs()[str(job_id)] == 1, timeout_s=60, what="A's run")
    first.proc.send_signal(signal.SIGSTOP)
    try:
        second = start_worker(**settings)
        with client.session_factory.begin() as session:  # the freeze outlasted the lease (2 s ago)
            session.execute(update(Job).where(Job.id == job_id).values(
                lease_expires_at=utcnow() - datetime.timedelta(seconds=2)))
        assert client.sweep(older_than_s=1) == 1  # the expired-lease path
        wait_until(lambda: runs()[str(job_id)] == 2, timeout_s=60, what="B's run")
        assert client.batch_status(batch_id).num_succeeded == 0  # B is still running it
    finally:
        first.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: "result dropped" in first.log(), timeout_s=60, what="A's late write refused")
    client.wait(batch_id, timeout_s=60)
    table = rows(client, batch_id)
    assert [(row[0], row[1], row[2]) for row in table.values()] == [(JobStatus.SUCCEEDED, 2, second.hostname)]
    assert f"job {job_id}: succeeded" in second.log()
    assert effects("jobs", [job_id]) == {str(job_id): 1}
    if products is not None:
        assert effects("product_enrichment", [f"{products}-0"]) == {f"{products}-0": 1}


def job_ids_in_redis(client):
    """The job ids of the messages of the model's queues that Redis holds: (waiting in a list,
    recorded by kombu as delivered and not acked yet, in the model's unacked hash)."""
    import base64
    import json

    from weir.worker.app import transport_options

    raw = redis.Redis.from_url(client.settings.worker.broker_url)

    def ids(envelope):
        body = json.loads(base64.b64decode(envelope["body"]))
        return {str(i) for i in body[0]}

    waiting, unacked = set(), set()
    for queue in names.job_queues(client.queue):
        for key in [queue.encode(), *raw.keys(f"{queue}\x06\x16*")]:
            if raw.type(key) == b"list":
                for entry in raw.lrange(key, 0, -1):
                    waiting |= ids(json.loads(entry))
    for entry in raw.hvals(transport_options(client.settings)["unacked_key"]):
        envelope, _exchange, routing_key = json.loads(entry)
        if routing_key in names.job_queues(client.queue):
            unacked |= ids(envelope)
    return waiting, unacked


@pytest.mark.parametrize("lane", ["interactive", "bulk chunks"])
def test_a_worker_killed_between_taking_a_message_and_recording_it_unacked_loses_nothing(
        start_worker, client, hooked, effects, lane):
    """kombu's Redis transport takes a message with BRPOP and only then records it in its unacked
    hash; a worker killed between the two leaves the message nowhere in Redis, so no redelivery
    can bring it back. The worker here dies so on its second message: the first is recorded
    unacked (its visibility timeout is an hour), the second is in neither place. The sweeper
    publishes both again (the queue moved past them, or their lease expired): every job is
    stored once, the lost message's jobs run once, the held one's at most once per claim."""
    from tests.worker.test_faults import assert_runs_and_writes

    env, runs = hooked
    num_jobs = 3 * CHUNK
    per_message = CHUNK if lane == "bulk chunks" else 1
    settings = dict(env, WEIR_LEASE_S="3", WEIR_CANCEL_POLL_INTERVAL_S="0.5")
    requests = [GenerateRequest(prompt=f"Product number {i}", custom_id=f"job-{i}", temperature=0, max_tokens=2)
                for i in range(num_jobs)]
    batch_id = client.enqueue_batch(requests, priority=BULK_PRIORITY if lane == "bulk chunks" else None)
    ids = {j.custom_id: str(j.id) for j in client.jobs(batch_id)}
    assert job_ids_in_redis(client) == (set(ids.values()), set())

    doomed = start_worker(**settings, WEIR_TEST_KILL_ON_FETCH="2")
    assert doomed.proc.wait(120) == -signal.SIGKILL
    waiting, held = job_ids_in_redis(client)
    lost = set(ids.values()) - waiting - held
    assert (len(held), len(lost)) == (per_message, per_message)  # one message unacked, one nowhere

    start_worker(**settings)
    republished = sweep_until_finished(client, batch_id, 90, "the lost message's jobs were not recovered")
    assert_each_succeeded_once(client, batch_id, num_jobs)
    # the sweeper stamped the lost message's jobs as published again, and maybe the held one's
    with client.session_factory() as session:
        stamps = dict(session.execute(select(Job.id, Job.published_at).where(Job.batch_id == batch_id)).all())
    first = min(stamps.values())
    assert lost <= {str(i) for i, t in stamps.items() if t != first} <= lost | held
    assert republished >= len(lost)
    assert {runs()[i] for i in lost} == {1}
    assert_runs_and_writes(client, batch_id, runs, effects, cut_short={c for c, i in ids.items() if i in held})


@pytest.mark.parametrize("lane", ["interactive", "bulk chunks"])
def test_an_unexpected_error_in_a_task_publishes_its_message_again_instead_of_acking_it(
        start_worker, client, hooked, effects, lane):
    """A delivery that raises something no outcome covers (here injected before the claim) is
    neither acked nor lost: the task publishes its message again after a backoff (1 s first), and
    the next delivery runs each job once."""
    from tests.worker.test_faults import assert_runs_and_writes

    env, runs = hooked
    worker = start_worker(**env, WEIR_TEST_ATTEMPT_ERRORS="1")
    num_jobs = CHUNK if lane == "bulk chunks" else 1
    requests = [GenerateRequest(prompt=f"Product number {i}", custom_id=f"job-{i}", temperature=0, max_tokens=2)
                for i in range(num_jobs)]
    batch_id = client.enqueue_batch(requests, priority=BULK_PRIORITY if lane == "bulk chunks" else None)
    client.wait(batch_id, timeout_s=60)
    what = f"chunk of {CHUNK} jobs" if lane == "bulk chunks" else f"job {client.jobs(batch_id)[0].id}"
    assert f"{what}: unexpected error; published again in 1s" in worker.log()
    assert_each_succeeded_once(client, batch_id, num_jobs)
    assert_runs_and_writes(client, batch_id, runs, effects)
