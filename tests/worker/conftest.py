import os
import signal
import subprocess
import sys
import time
import uuid

import pytest


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory):
    """The tiny chat model with 16 layers instead of 2: ~6 ms a token on the 2-core VM, so a
    480-token job runs ~3 s while a 1-token job takes ~10 ms (for timeouts, grace periods and
    cancels that must catch a job in flight, whatever the engine's speed-ups)."""
    from weir.jobs.testing import save_tiny_chat_model

    return save_tiny_chat_model(str(tmp_path_factory.mktemp("slow-chat-llama")), num_hidden_layers=16)


@pytest.fixture
def queue(redis_url):
    """A queue name no other run uses; its Redis keys are deleted afterwards."""
    import redis

    name = f"weir.test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    keys = [name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}"]
    client.delete(*(keys + list(client.scan_iter(f"{name}*"))))


class WorkerProcess:
    """A ``python -m weir worker`` subprocess with its log in a file."""

    def __init__(self, env: dict, log_path: str):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weir", "worker", "--loglevel", "INFO"],
            cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if " ready." in self.log():  # it may have died since, of the first job it took
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {timeout_s}s:\n{self.log()[-4000:]}")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout_s: float = 120) -> int:
        """Warm shutdown (SIGTERM): running tasks finish, the engine drains."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def sigkill(self) -> None:
        """Kill the process at once (no shutdown, unacked messages stay with Redis)."""
        self.proc.kill()
        self.proc.wait()

    @property
    def hostname(self) -> str:
        """The Celery hostname the worker stores on the jobs it claims."""
        return f"weir-{self.proc.pid}@{os.uname().nodename}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def worker_env(postgres_url, tiny_model_dir, redis_url, queue):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        WEIR_BROKER_URL=redis_url,
        WEIR_QUEUE=queue,
        WEIR_DATABASE_URL=postgres_url,
        WEIR_MODEL=tiny_model_dir,
        WEIR_DEVICE="cpu",
        WEIR_MAX_NUM_SEQS="4",
        WEIR_CONCURRENCY="4",
        WEIR_CPU_KV_CACHE_BYTES=str(8 << 20),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.fixture
def client(worker_env):
    """A producer ``Client`` for the workers' queue, database and model."""
    from weir.jobs.client import Client
    from weir.config import DatabaseSettings, EngineSettings, Settings, WorkerSettings

    settings = Settings(
        engine=EngineSettings(model=worker_env["WEIR_MODEL"]),
        worker=WorkerSettings(broker_url=worker_env["WEIR_BROKER_URL"], queue=worker_env["WEIR_QUEUE"]),
        database=DatabaseSettings(database_url=worker_env["WEIR_DATABASE_URL"]),
    )
    client = Client(settings)
    yield client
    client.close()


@pytest.fixture
def start_worker(worker_env, tmp_path):
    """Start ``weir worker`` processes (env overrides as keyword arguments); all killed at the end."""
    started = []

    def start(**overrides) -> WorkerProcess:
        env = dict(worker_env, **overrides)
        worker = WorkerProcess(env, str(tmp_path / f"worker-{len(started)}.log"))
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.kill()
