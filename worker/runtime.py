"""What one worker process holds while it runs: the engine and the results database.

The engine is built once per process when the worker starts (Celery's ``worker_init`` signal, sent
before the consumer takes any message) and shared by every task thread through ``EngineFront``,
whose single step loop batches the requests of all threads together. It is drained on warm
shutdown (``worker_shutdown``, sent after the pool has finished its running tasks).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from jobs.db import Job, JobKind, JobStatus, make_engine, make_session_factory
from jobs.schemas import ClassifyRequest, GenerateRequest, parse_request
from jobs.store import JobResult
from weir.config import Settings, get_settings

logger = logging.getLogger(__name__)


class EngineStopping(RuntimeError):
    """The engine no longer takes requests: the worker is shutting down."""


class WorkerRuntime:
    """Owns one process's ``engine.LLM``, its ``EngineFront``, and a database session factory.

    Invariant: between :meth:`start` and :meth:`shutdown` the front accepts requests; after
    :meth:`shutdown` returns every submitted request has finished (drain) or failed.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.llm = None
        self.front = None
        self.db_engine = make_engine(settings.database.url())
        self.session_factory = make_session_factory(self.db_engine)
        self._stopping = False

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

    def shutdown(self, drain: bool = True) -> None:
        """Stop taking requests, finish (``drain=True``) or fail the submitted ones, close the database."""
        self._stopping = True
        if self.front is not None:
            self.front.shutdown(drain=drain)
            logger.info("engine stopped; counters: %s", self.front.stats())
        self.db_engine.dispose()

    def run(self, job: Job) -> JobResult:
        """Run one claimed job through the engine and wait for it.

        A job the engine refuses or fails (empty or too long prompt, bad request JSON, an error in
        the engine step) comes back as a failed result carrying the reason; the worker goes on.

        Raises:
            EngineStopping: the engine is shutting down; the job was not run and should be redelivered.
        """
        if self._stopping:
            raise EngineStopping("the engine is shutting down")
        try:
            request = parse_request(job.request)
            if job.kind == JobKind.CLASSIFY:
                return self._classify(request)
            return self._generate(request)
        except Exception as exc:  # the job's failure, not the worker's: record it and go on
            if self._stopping and isinstance(exc, RuntimeError):
                raise EngineStopping(str(exc)) from exc
            logger.warning("job %s failed: %s: %s", job.id, type(exc).__name__, exc)
            return JobResult.failure(f"{type(exc).__name__}: {exc}")

    def _generate(self, request: GenerateRequest) -> JobResult:
        from engine import SamplingParams

        params = SamplingParams(**request.sampling_fields())
        output = self.front.submit_generate(request.engine_prompt(), params).result()
        completion = output.outputs[0]
        return JobResult(
            status=JobStatus.SUCCEEDED,
            output_text=completion.text,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_completion_tokens=len(completion.token_ids),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _classify(self, request: ClassifyRequest) -> JobResult:
        output = self.front.submit_classify(
            request.engine_prompt(), request.labels, request.label_texts, request.engine_calibration_prompt()
        ).result()
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


def stop_runtime(drain: bool = True) -> None:
    """Shut down this process's runtime, if any (see :meth:`WorkerRuntime.shutdown`)."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.shutdown(drain=drain)
