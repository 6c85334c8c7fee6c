"""``WorkerRuntime.run`` in this process with a small random-weight model: a cancelled or timed-out
job is aborted in the engine and every KV block it held is free again."""

import threading
import time
import uuid

import pytest

from weir.jobs.db import Job, JobKind, JobStatus
from weir.jobs.schemas import GenerateRequest
from weir.config import CacheSettings, DatabaseSettings, EngineSettings, Settings, WorkerSettings
from weir.worker.runtime import EngineStopping, JobCancelled, JobTimedOut, WorkerRuntime


@pytest.fixture(scope="module")
def runtime(slow_model_dir, tmp_path_factory):
    settings = Settings(
        engine=EngineSettings(model=slow_model_dir, device="cpu", max_num_seqs=2),
        cache=CacheSettings(cpu_kv_cache_bytes=8 << 20),
        worker=WorkerSettings(cancel_poll_interval_s=0.05, job_timeout_s=30),
        database=DatabaseSettings(sqlite_path=str(tmp_path_factory.mktemp("db") / "weir.db")),
    )
    runtime = WorkerRuntime(settings)
    runtime.start()
    yield runtime
    runtime.shutdown(drain=False)


def test_the_engine_core_process_waits_for_openmp_work_with_a_short_spin(runtime):
    with open(f"/proc/{runtime.front.process.pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    assert b"GOMP_SPINCOUNT=3000" in environ


def long_job(max_tokens=480):
    request = GenerateRequest(prompt="A long story", temperature=0, max_tokens=max_tokens)
    return Job(id=uuid.uuid4(), kind=JobKind.GENERATE, request=request.model_dump(mode="json", exclude_none=True))


def usage_when_idle(runtime):
    def idle():
        stats = runtime.front.stats()
        return stats["num_requests_running"] + stats["num_requests_waiting"] == 0

    deadline = time.monotonic() + 5
    while not idle():
        assert time.monotonic() < deadline, "the engine still holds the request"
        time.sleep(0.01)
    return runtime.front.stats()["kv_cache_usage_perc"]


def test_a_finished_job_succeeds(runtime):
    result = runtime.run(long_job(max_tokens=3))
    assert (result.status, result.num_completion_tokens, result.finish_reason) == (JobStatus.SUCCEEDED, 3, "length")


def test_cancel_while_running_aborts_and_frees_every_block(runtime):
    runtime.front.reset_prefix_cache()
    job = long_job()
    runtime.hold(job)
    threading.Timer(0.2, runtime.lease_lost, args=(job.id,)).start()  # what the lease renewer finds
    started = time.monotonic()
    with pytest.raises(JobCancelled, match="cancelled or its lease lost while running; aborted"):
        runtime.run(job)
    runtime.drop(job)
    assert time.monotonic() - started < 1.0  # 480 tokens take ~3 s on this model
    runtime.front.reset_prefix_cache()
    assert usage_when_idle(runtime) == 0.0


def test_timeout_aborts_and_frees_every_block(runtime):
    with pytest.raises(JobTimedOut, match=r"no result after 0.2s \(WEIR_JOB_TIMEOUT_S\); aborted"):
        runtime.run(long_job(), timeout_s=0.2)
    runtime.front.reset_prefix_cache()
    assert usage_when_idle(runtime) == 0.0


def test_past_the_shutdown_grace_period_running_jobs_are_handed_back(runtime):
    errors = []

    def run():
        try:
            runtime.run(long_job())
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    runtime.begin_shutdown(0.2)
    thread.join(5)
    assert [type(e) for e in errors] == [EngineStopping]
    with pytest.raises(EngineStopping):
        runtime.run(long_job(max_tokens=2))


def test_a_normal_shutdown_logs_the_database_writes_at_info(tmp_path, caplog):
    import logging

    settings = Settings(database=DatabaseSettings(sqlite_path=str(tmp_path / "weir.db")))
    runtime = WorkerRuntime(settings)  # no model: only the writer is started
    runtime.writer("weir-1@host")
    with caplog.at_level(logging.DEBUG, logger="weir.worker.runtime"):
        runtime.shutdown()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "weir.worker.runtime"] == [
        ("INFO", "database writes: 0 operations in 0 transactions, 0.0 s in the database")]


def test_a_start_that_fails_after_the_engine_core_was_spawned_leaves_no_engine_core(
        slow_model_dir, tmp_path, monkeypatch):
    """The engine core process is spawned before the worker imports the engine side: a failure in
    between (here the client refusing) kills it rather than leaving it loading a model."""
    from weir.engine import core_client, core_process

    spawned = []

    def spawn(*args, **kwargs):
        spawned.append(real_spawn(*args, **kwargs))
        return spawned[-1]

    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    real_spawn = core_process.start_core_process
    monkeypatch.setattr(core_process, "start_core_process", spawn)
    monkeypatch.setattr(core_client, "EngineCoreClient", refuse)
    runtime = WorkerRuntime(Settings(
        engine=EngineSettings(model=slow_model_dir, device="cpu", max_num_seqs=2),
        cache=CacheSettings(cpu_kv_cache_bytes=8 << 20),
        database=DatabaseSettings(sqlite_path=str(tmp_path / "weir.db"))))
    with pytest.raises(RuntimeError, match="refused"):
        runtime.start()
    [(process, _)] = spawned
    process.join(10)
    assert not process.is_alive()
