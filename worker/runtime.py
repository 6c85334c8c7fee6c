"""What one worker process holds while it runs: the engine and the results database.

The engine is built once per process when the worker starts (Celery's ``worker_init`` signal, sent
before the consumer takes any message) and shared by every task thread through ``EngineFront``,
whose single step loop batches the requests of all threads together. It is drained on warm
shutdown (``worker_shutdown``, sent after the pool has finished its running tasks).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from jobs.db import Job, JobKind, JobStatus, make_engine, make_session_factory
from jobs.schemas import parse_request
from jobs.store import JobResult
from weir.config import Settings, get_settings

logger = logging.getLogger(__name__)


class EngineStopping(RuntimeError):
    """The engine no longer takes requests: the worker is shutting down."""


class JobTimedOut(RuntimeError):
    """One attempt of a job ran past ``WEIR_JOB_TIMEOUT_S``; it was aborted in the engine."""


class JobCancelled(RuntimeError):
    """The job was cancelled while it ran; it was aborted in the engine and nothing is stored."""


class WorkerRuntime:
    """Owns one process's ``engine.LLM``, its ``EngineFront``, and a database session factory.

    Invariant: between :meth:`start` and :meth:`shutdown` the front accepts requests; after
    :meth:`shutdown` returns every submitted request has finished (drain) or failed. Every request
    :meth:`run` submitted and still waits for is in ``_running``, so a shutdown past its grace
    period can abort them all.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.llm = None
        self.front = None
        self.db_engine = make_engine(settings.database.url())
        self.session_factory = make_session_factory(self.db_engine)
        self._stopping = False
        self._running: set[Future] = set()
        self._running_lock = threading.Lock()
        self._grace_timer: Optional[threading.Timer] = None

    @property
    def model_name(self) -> str:
        return self.llm.model_name

    def start(self) -> None:
        """Load the model and start the engine's step loop.

        Raises:
            FileNotFoundError, ValueError: the model or an engine argument is unusable.
        """
        from engine import LLM, EngineFront

        self.llm = LLM(**self.settings.engine_args())
        self.front = EngineFront(self.llm)
        logger.info("engine ready: model %s, max_model_len %d", self.llm.model_name, self.llm.max_model_len)

    @property
    def is_stopping(self) -> bool:
        return self._stopping

    def begin_shutdown(self, grace_s: float) -> None:
        """Warm shutdown has begun: running jobs get ``grace_s`` seconds, then :meth:`abort_running`."""
        if self._grace_timer is None:
            self._grace_timer = threading.Timer(grace_s, self.abort_running)
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def abort_running(self) -> None:
        """Stop taking jobs and abort every request :meth:`run` waits for (their blocks are freed);
        those runs raise :class:`EngineStopping`, so their messages go back to the queue."""
        self._stopping = True
        with self._running_lock:
            running = list(self._running)
        if running:
            logger.warning("shutdown grace period over: %d running jobs go back to the queue", len(running))
        for future in running:
            self.front.abort(future)

    def shutdown(self, drain: bool = True) -> None:
        """Stop taking requests, finish (``drain=True``) or fail the submitted ones, close the database."""
        self._stopping = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        if self.front is not None:
            self.front.shutdown(drain=drain)
            logger.info("engine stopped; counters: %s", self.front.stats())
        self.db_engine.dispose()

    def run(
        self, job: Job, *, is_cancelled: Callable[[], bool] = lambda: False, timeout_s: Optional[float] = None
    ) -> JobResult:
        """Run one claimed job through the engine and wait for it.

        A job the engine refuses or fails (empty or too long prompt, bad request JSON, an error in
        the engine step) comes back as a failed result carrying the reason; the worker goes on.
        While it waits, every ``WEIR_CANCEL_POLL_INTERVAL_S`` it asks ``is_cancelled()``.

        Args:
            job: the claimed job row.
            is_cancelled: True once the job was cancelled (a database read).
            timeout_s: the most seconds the engine may take; default ``WEIR_JOB_TIMEOUT_S``.

        Raises:
            EngineStopping: the engine is shutting down; the job should be redelivered.
            JobTimedOut: past ``timeout_s``; the request was aborted.
            JobCancelled: ``is_cancelled()`` said so; the request was aborted.
        """
        if self._stopping:
            raise EngineStopping("the engine is shutting down")
        timeout_s = self.settings.worker.job_timeout_s if timeout_s is None else timeout_s
        try:
            request = parse_request(job.request)
            if job.kind == JobKind.CLASSIFY:
                future = self.front.submit_classify(
                    request.engine_prompt(), request.labels, request.label_texts,
                    request.engine_calibration_prompt(),
                )
            else:
                from engine import SamplingParams

                future = self.front.submit_generate(
                    request.engine_prompt(), SamplingParams(**request.sampling_fields())
                )
        except Exception as exc:  # the job's failure, not the worker's: record it and go on
            return self._failure(job, exc)
        output = self._wait(future, is_cancelled, timeout_s)
        if isinstance(output, Exception):
            return self._failure(job, output)
        if job.kind == JobKind.CLASSIFY:
            return self._classified(output)
        return self._generated(output)

    def _wait(self, future: Future, is_cancelled: Callable[[], bool], timeout_s: float):
        """The future's result, or the request's own error as a value; raises as :meth:`run` says."""
        deadline = time.monotonic() + timeout_s
        poll_s = self.settings.worker.cancel_poll_interval_s
        with self._running_lock:
            self._running.add(future)
        try:
            while True:
                remaining_s = deadline - time.monotonic()
                try:
                    return future.result(timeout=max(0.0, min(poll_s, remaining_s)))
                except FutureTimeout:
                    pass
                except CancelledError:  # aborted by abort_running
                    raise EngineStopping("the engine is shutting down") from None
                except Exception as exc:
                    if self._stopping:
                        raise EngineStopping(str(exc)) from exc
                    return exc
                if self._stopping and future.cancelled():
                    raise EngineStopping("the engine is shutting down")
                if time.monotonic() >= deadline:
                    self.front.abort(future)
                    raise JobTimedOut(f"no result after {timeout_s:g}s (WEIR_JOB_TIMEOUT_S); aborted")
                if is_cancelled():
                    self.front.abort(future)
                    raise JobCancelled("cancelled while running; aborted")
        finally:
            with self._running_lock:
                self._running.discard(future)

    def _failure(self, job: Job, exc: Exception) -> JobResult:
        logger.warning("job %s failed: %s: %s", job.id, type(exc).__name__, exc)
        return JobResult.failure(f"{type(exc).__name__}: {exc}")

    def _generated(self, output) -> JobResult:
        completion = output.outputs[0]
        return JobResult(
            status=JobStatus.SUCCEEDED,
            output_text=completion.text,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_completion_tokens=len(completion.token_ids),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _classified(self, output) -> JobResult:
        return JobResult(
            status=JobStatus.SUCCEEDED,
            label=output.label,
            label_probs=dict(output.probs),
            num_prompt_tokens=output.num_prompt_tokens,
            num_completion_tokens=0,
            num_cached_tokens=output.num_cached_tokens,
        )


_runtime: Optional[WorkerRuntime] = None
_runtime_lock = threading.Lock()


def start_runtime(settings: Optional[Settings] = None) -> WorkerRuntime:
    """Build and start this process's runtime, once; later calls return the running one."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            runtime = WorkerRuntime(settings or get_settings())
            runtime.start()
            _runtime = runtime
        return _runtime


def get_runtime() -> WorkerRuntime:
    """The runtime started by :func:`start_runtime`.

    Raises:
        RuntimeError: the worker did not start one (tasks only run inside a started worker).
    """
    if _runtime is None:
        raise RuntimeError("no engine in this process: tasks run only in a started weir worker")
    return _runtime


def current_runtime() -> Optional[WorkerRuntime]:
    """The started runtime, or None (signal handlers that may run in any process use this)."""
    return _runtime


def stop_runtime(drain: bool = True) -> None:
    """Shut down this process's runtime, if any (see :meth:`WorkerRuntime.shutdown`)."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.shutdown(drain=drain)
