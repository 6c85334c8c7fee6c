"""The worker-subprocess harness the worker tests and the soak and pipeline benchmarks share."""

import os
import sys

import pytest

from weir.worker.testing import WorkerProcess, worker_env


def test_worker_env_of_a_small_cpu_engine(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/already")
    env = worker_env(broker_url="redis://r/0", queue="q", database_url="postgresql://d", model="/m",
                     concurrency=3, python_path=["/hook", "/repo"], WEIR_LEASE_S=5)
    assert {k: v for k, v in env.items() if k.startswith("WEIR_") or k in ("PYTHONPATH", "OMP_NUM_THREADS")} == {
        "PYTHONPATH": os.pathsep.join(["/hook", "/repo", "/already"]),
        "WEIR_BROKER_URL": "redis://r/0", "WEIR_QUEUE": "q", "WEIR_DATABASE_URL": "postgresql://d",
        "OMP_NUM_THREADS": "1", "WEIR_MODEL": "/m", "WEIR_DEVICE": "cpu", "WEIR_MAX_NUM_SEQS": "3",
        "WEIR_CONCURRENCY": "3", "WEIR_CPU_KV_CACHE_BYTES": str(8 << 20), "WEIR_LEASE_S": "5",
    }


def test_worker_env_without_an_engine(monkeypatch):
    for name in [k for k in os.environ if k.startswith("WEIR_")]:
        monkeypatch.delenv(name)
    env = worker_env(broker_url="redis://r/0", queue="q", database_url="sqlite://")
    assert sorted(k for k in env if k.startswith("WEIR_")) == ["WEIR_BROKER_URL", "WEIR_DATABASE_URL", "WEIR_QUEUE"]


def _process(tmp_path, code: str) -> WorkerProcess:
    env = worker_env(broker_url="redis://127.0.0.1:1/0", queue="q", database_url="sqlite://")
    return WorkerProcess(env, str(tmp_path / "w.log"), [sys.executable, "-c", code])


def test_ready_then_warm_shutdown(tmp_path):
    worker = _process(tmp_path, "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
                                "print('w@h ready.', flush=True)\n"
                                "time.sleep(60)\n")
    worker.wait_ready(timeout_s=30)
    assert worker.is_alive() and worker.is_ready()
    assert worker.terminate(timeout_s=30) == 3
    assert worker.log() == "w@h ready.\n"


def test_a_worker_that_dies_first_is_reported_with_its_log(tmp_path):
    worker = _process(tmp_path, "import sys; print('cannot start the engine'); sys.exit(70)")
    with pytest.raises(RuntimeError, match="worker exited with 70:\ncannot start the engine"):
        worker.wait_ready(timeout_s=30)
    worker.kill()
