"""Worker subprocesses for integration tests and benchmarks (as ``celery.contrib.testing`` is to
Celery): ``tests/worker`` and ``bench/soak.py``, ``bench/pipeline.py`` start ``weir worker``
through this module, with the same environment, readiness check, shutdown and queue clean-up.

Nothing here runs in a production worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

READY_TIMEOUT_S = 180.0
POLL_INTERVAL_S = 0.2
READY_LINE = " ready."
"""What Celery logs (at INFO) once a worker consumes; ``bench/pipeline_baseline.py`` logs it too."""
TINY_CPU_KV_CACHE_BYTES = 8 << 20


def service_urls() -> tuple[str, str]:
    """The Redis URL and the Postgres admin URL (a database the user may CREATE DATABASE from)
    that tests and benchmarks use: ``WEIR_TEST_REDIS_URL`` and ``WEIR_TEST_POSTGRES_URL``, else
    the local defaults. These are knobs of the test set-up, not weir's settings."""
    return (
        os.environ.get("WEIR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        os.environ.get("WEIR_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"),
    )


def worker_env(
    *,
    broker_url: str,
    queue: str,
    database_url: str,
    model: Optional[str] = None,
    concurrency: int = 4,
    python_path: Sequence[str] = (),
    **overrides: object,
) -> dict[str, str]:
    """The environment of a worker subprocess on CPU: this process's environment plus the
    ``WEIR_*`` variables of one queue, one database and, with ``model``, a small engine
    (``WEIR_MAX_NUM_SEQS = WEIR_CONCURRENCY = concurrency``, an 8 MiB KV cache, one OpenMP thread).

    Args:
        broker_url, queue, database_url: ``WEIR_BROKER_URL``, ``WEIR_QUEUE``, ``WEIR_DATABASE_URL``.
        model: ``WEIR_MODEL``; None sets none of the engine's variables (a worker without weir's engine).
        concurrency: task threads and requests per engine step.
        python_path: folders put first on ``PYTHONPATH`` (the repository root, a test hook).
        overrides: more variables, by name (``WEIR_LEASE_S=5``); values become strings.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*python_path, env.get("PYTHONPATH", "")])
    env.update(WEIR_BROKER_URL=broker_url, WEIR_QUEUE=queue, WEIR_DATABASE_URL=database_url, OMP_NUM_THREADS="1")
    if model is not None:
        env.update(
            WEIR_MODEL=model,
            WEIR_DEVICE="cpu",
            WEIR_MAX_NUM_SEQS=str(concurrency),
            WEIR_CONCURRENCY=str(concurrency),
            WEIR_CPU_KV_CACHE_BYTES=str(TINY_CPU_KV_CACHE_BYTES),
        )
    env.update({name: str(value) for name, value in overrides.items()})
    return env


class WorkerProcess:
    """One worker subprocess, ``python -m weir worker`` unless told otherwise, with its output in
    a log file.

    Args:
        env: its environment (:func:`worker_env`).
        log_path: the file its stdout and stderr go to (appended).
        argv: the command; default ``python -m weir worker --loglevel INFO``.
        cwd: its working directory; default this process's.
    """

    def __init__(self, env: dict, log_path: str, argv: Optional[list[str]] = None, cwd: Optional[str] = None):
        self.env = env
        self.log_path = log_path
        argv = argv or [sys.executable, "-m", "weir", "worker", "--loglevel", "INFO"]
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)

    @property
    def hostname(self) -> str:
        """The Celery node name ``weir worker`` gives itself (stored on the jobs it claims)."""
        return f"weir-{self.proc.pid}@{os.uname().nodename}"

    @property
    def queue(self) -> str:
        """The queue it consumes: ``WEIR_QUEUE``, else the one of ``WEIR_MODEL``."""
        from weir.jobs import names

        return names.queue_for_model(self.env.get("WEIR_MODEL"), self.env.get("WEIR_QUEUE"))

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def is_ready(self) -> bool:
        """Whether it has logged :data:`READY_LINE` (it may have died since)."""
        return READY_LINE in self.log()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        """Raises RuntimeError, with the log's tail, when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, *, ping: bool = False) -> None:
        """Block until it logs :data:`READY_LINE`, or, with ``ping``, answers as :attr:`hostname`
        on ``WEIR_BROKER_URL`` that it consumes :attr:`queue` (a worker logging at WARNING writes no
        ready line).

        Raises:
            RuntimeError: it exited first, or is not ready after ``timeout_s``.
        """
        from weir.health import check_worker

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_ready():
                return
            if ping and check_worker(self.env["WEIR_BROKER_URL"], self.queue, hostname=self.hostname,
                                     timeout_s=1.0).healthy:
                return
            self.check_alive()
            time.sleep(POLL_INTERVAL_S)
        raise RuntimeError(f"worker not ready after {timeout_s:g}s:\n{self.log()[-4000:]}")

    def terminate(self, timeout_s: float = 120.0) -> int:
        """Warm shutdown (SIGTERM): running tasks finish, reserved messages go back, the engine
        drains. Returns the exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout_s``.
        """
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """:meth:`terminate`, then SIGKILL when it still runs after ``grace_s``."""
        if self.proc.poll() is not None:
            return
        try:
            self.terminate(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL now, if it still runs: no shutdown, its unacked messages stay with Redis."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    sigkill = kill


def delete_queue_keys(redis_client, queue: str) -> None:
    """Delete a queue's Redis keys (its list, kombu's bindings, its own ``<queue>.unacked*``
    keys) and its messages in kombu's shared ``unacked`` hash, where a killed worker of an app
    without per-queue unacked keys leaves them (another consumer of this Redis database would
    restore them one visibility timeout later).

    Args:
        redis_client: a ``redis.Redis``.
        queue: the queue's name.
    """
    keys = [queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}",
            *redis_client.scan_iter(match=f"{queue}*")]
    redis_client.delete(*keys)
    for tag, value in redis_client.hscan_iter("unacked"):
        try:
            _, exchange, routing_key = json.loads(value)
        except (TypeError, ValueError):
            continue
        if queue in (exchange, routing_key):
            redis_client.hdel("unacked", tag)
            redis_client.zrem("unacked_index", tag)
