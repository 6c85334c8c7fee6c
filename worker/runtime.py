"""What one worker process holds while it runs: the engine and the results database.

The engine is built once per process when the worker starts (Celery's ``worker_init`` signal, sent
before the consumer takes any message) and shared by every task thread through one front
(``weir.engine.core_client.EngineCoreClient``: the engine core, whose single step loop batches the
requests of all threads together, runs in a process of its own, so the job side's threads never
hold its GIL; ``WEIR_ENGINE_MULTIPROCESSING=false`` runs it on a thread here, ``EngineFront``). It
is drained on warm shutdown (``worker_shutdown``, sent after the pool has finished its running
tasks).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

from weir.config import Settings, get_settings
from weir.engine.sampling_params import SamplingParams
from weir.jobs import applications, claims
from weir.jobs.db import Job, JobKind, JobStatus, engine_for, make_session_factory, watchdog
from weir.jobs.model_info import too_long_for_output
from weir.jobs.results import JobResult, parse_json_output
from weir.jobs.retry import first_line, is_transient
from weir.jobs.schemas import GenerateRequest, JobRequest, parse_request
from weir.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 70
"""The worker's exit status when its engine keeps failing (EX_SOFTWARE): a supervisor restarts it
and its messages go to other workers meanwhile."""


class EngineStopping(RuntimeError):
    """The engine no longer takes requests: the worker is shutting down. ``started``: whether the
    job had reached the engine (a start cut short) or not (then it never ran)."""

    def __init__(self, message: str, *, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


class JobTimedOut(RuntimeError):
    """One attempt of a job ran past ``WEIR_JOB_TIMEOUT_S``; it was aborted in the engine."""


class JobCancelled(RuntimeError):
    """The job was cancelled while it ran, or its lease was lost (another claim took it after it
    expired); it was aborted in the engine and nothing is stored."""


class EngineFailed(RuntimeError):
    """An engine step failed with the job in flight (not the job's own fault): the job goes back
    to the queue. After ``WEIR_MAX_ENGINE_FAILURES`` failed steps in a row the worker exits with
    :data:`EXIT_ENGINE_FAILED`."""


CHUNK_SLOTS_PER_SEQ = 2
"""A worker keeps at most this many chunk requests in its engine per ``max_num_seqs``."""


def max_chunks(settings: Settings) -> int:
    """Chunks one worker runs at once, and the prefetch window of its bulk queue: enough to fill
    its engine's places (``CHUNK_SLOTS_PER_SEQ * max_num_seqs`` requests of
    ``WEIR_BULK_CHUNK_SIZE`` jobs each, rounded up) and have the next chunk claimed, never more
    than half the model queue's task threads. More would only hold claimed jobs, or messages,
    that other workers could run."""
    threads = settings.worker.concurrency or settings.engine.max_num_seqs
    places = CHUNK_SLOTS_PER_SEQ * settings.engine.max_num_seqs
    return max(1, min(max(1, threads // 2), -(-places // settings.worker.bulk_chunk_size) + 1))


class WorkerRuntime:
    """Owns one process's engine front (the engine core process, or ``engine.LLM`` and its
    ``EngineFront``), a database session factory and its
    :class:`weir.worker.metrics.WorkerMetrics` (a registry of its own; served on
    ``WEIR_METRICS_PORT`` when set, which also attaches the engine's stat logger).

    Invariant: between :meth:`start` and :meth:`shutdown` the front accepts requests; after
    :meth:`shutdown` returns every submitted request has finished (drain) or failed. Every request
    :meth:`run` submitted and still waits for is in ``_running``, so a shutdown past its grace
    period can abort them all.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.llm = None
        self.front = None
        # the applications' say on whether a generation runs once more (the catalog's description retry)
        self.post_run_policies = list(applications.load(applications.POST_RUN_POLICIES).values())
        # No pre-ping: a checkout would wait on a silent database outside any watchdog; a dead
        # pooled connection fails its first statement instead, which is retried.
        self.db_engine = engine_for(settings.database, pool_pre_ping=False)
        self.session_factory = make_session_factory(self.db_engine)
        self._stopping = False
        self._grace_over = False  # warm shutdown's grace period is over: pending writes give up
        self._running: set[Future] = set()
        self._running_lock = threading.Lock()
        self._grace_timer: Optional[threading.Timer] = None
        # Leases this process holds: job id -> (fencing token, engine future or None).
        self._leases: dict = {}
        self._lost: set = set()
        self._worker_name: Optional[str] = None
        self.committer = None
        self._heartbeat: Optional[threading.Thread] = None
        self._heartbeat_stop = threading.Event()
        self.engine_failed = False
        self._watchdog_s = settings.database.statement_timeout_s + 5.0
        self.metrics = WorkerMetrics()
        self._log_stats: Optional[threading.Thread] = None
        # requests of chunks in the engine at once: enough to keep every sequence slot busy and
        # the next step's requests waiting, few enough that a queued request's timeout is not
        # spent waiting behind a whole backlog
        self._chunk_slots = threading.BoundedSemaphore(CHUNK_SLOTS_PER_SEQ * settings.engine.max_num_seqs)
        # threads holding a chunk, running or waiting to: at most half of the model queue's (the
        # others stay free for its per-job messages and the control queue's); the bulk queue's
        # window holds no more than max_chunks, so only chunks found in the model queue itself
        # (published there by an earlier client) can reach this limit
        self.max_chunk_threads = max(1, (settings.worker.concurrency or settings.engine.max_num_seqs) // 2)
        self.max_chunks = max_chunks(settings)
        self._num_chunks = 0
        self._chunk_threads = 0
        self._chunk_cv = threading.Condition()

    @property
    def model_name(self) -> str:
        return self.front.model_name

    def start(self) -> None:
        """Serve the metrics (``WEIR_METRICS_PORT``), load the model, start the engine's step loop
        and the periodic stats line (``WEIR_LOG_STATS_INTERVAL_S``).

        Raises:
            MetricsPortUnavailable: the metrics port cannot be listened on (checked first, before
                the model loads).
            FileNotFoundError, ValueError: the model or an engine argument is unusable.
        """
        from weir.engine.core_process import start_core_process
        from weir.engine.openmp import limit_omp_spinning
        from weir.worker.placement import bind_process, plan

        settings = self.settings.worker
        if settings.metrics_port:
            self.metrics.serve(settings.metrics_port)
        started = None
        try:
            if settings.engine_multiprocessing:
                # the engine core imports torch and loads the model while this process imports
                # the rest (seconds of each, side by side)
                placement = plan(settings.cpu_omp_threads_bind, settings.cpu_num_of_reserved_cpu)
                spincount = limit_omp_spinning()
                engine_args, collect_stats = self.settings.engine_args(), bool(settings.metrics_port)
                started = start_core_process(engine_args, collect_stats=collect_stats,
                                             num_threads=placement.engine_threads, cpu_affinity=placement.engine_cpus)
            from weir.engine import LLM, EngineFront
            from weir.engine.core_client import EngineCoreClient
            from weir.worker.metrics import attach

            if settings.metrics_port and settings.broker_url:
                self._watch_queues()
            if settings.engine_multiprocessing:
                self.front = EngineCoreClient(engine_args, collect_stats=collect_stats,
                                              num_threads=placement.engine_threads,
                                              cpu_affinity=placement.engine_cpus,
                                              iteration_timeout_s=settings.engine_iteration_timeout_s,
                                              started=started)
                started = None  # the client owns it
                if placement.job_cpus is not None:
                    bind_process(placement.job_cpus)
                logger.info("threads: %s, GOMP_SPINCOUNT %s", placement.describe(), spincount or "OpenMP's")
            else:
                self.llm = LLM(**self.settings.engine_args())
                self.front = EngineFront(self.llm)
        except BaseException:
            if started is not None:  # failed before the client took the process over
                started[0].kill()
            self.metrics.close()
            raise
        if settings.metrics_port:
            attach(self.metrics, self.front)
        logger.info("engine ready: model %s, max_model_len %d%s", self.front.model_name, self.front.max_model_len,
                    f", engine core pid {self.front.process.pid}" if settings.engine_multiprocessing else "")
        if settings.log_stats_interval_s:
            self._log_stats = threading.Thread(target=self._log_stats_loop, args=(settings.log_stats_interval_s,),
                                               name="weir-log-stats", daemon=True)
            self._log_stats.start()

    def _watch_queues(self) -> None:
        """Report the depth of each of the model's queues (``names.job_queues``) at each scrape."""
        from weir.jobs import names
        from weir.jobs.client import num_waiting_messages
        from weir.worker.app import app, model_queue

        queue = model_queue(self.settings)
        self.metrics.watch_queues(lambda q: num_waiting_messages(app, q, timeout_s=2.0),
                                  names.job_queues(queue))

    def _log_stats_loop(self, interval_s: float) -> None:
        """vLLM's periodic line (:class:`weir.engine.stats.LoggingStatLogger`) until shutdown."""
        from weir.engine.stats import LoggingStatLogger

        stat_logger = LoggingStatLogger(self.front.stats)
        while not self._heartbeat_stop.wait(interval_s):
            stat_logger.log()

    def writer(self, worker_name: str):
        """This process's :class:`weir.worker.group_commit.GroupCommitter` (made on first use, with
        the Celery worker's name, which claims store) and its lease renewer."""
        from weir.worker.group_commit import GroupCommitter

        with self._running_lock:
            if self.committer is None:
                settings = self.settings.worker
                self._worker_name = worker_name
                self.committer = GroupCommitter(
                    self.session_factory, worker=worker_name, lease_s=settings.lease_s,
                    max_attempts=settings.max_attempts, model_name=lambda: self.model_name,
                    retry_timeout_s=settings.db_retry_timeout_s,
                    statement_timeout_s=self.settings.database.statement_timeout_s,
                    max_jobs=settings.commit_max_jobs, max_wait_s=settings.commit_max_wait_s,
                    is_stopping=lambda: self._grace_over, write_latency_s=self.metrics.db_write_latency,
                )
                self._heartbeat = threading.Thread(target=self._renew_leases, name="weir-leases", daemon=True)
                self._heartbeat.start()
            return self.committer

    def hold(self, job: Job) -> None:
        """Register a claimed job's lease, renewed from now on until :meth:`drop`."""
        with self._running_lock:
            self._leases[job.id] = [job.lease_token, None]

    def drop(self, job: Job) -> None:
        with self._running_lock:
            self._leases.pop(job.id, None)
            self._lost.discard(job.id)

    def _renew_leases(self) -> None:
        """Every ``WEIR_CANCEL_POLL_INTERVAL_S``: renew every lease this process holds in one
        statement; a job whose lease was not renewed (cancelled, or taken by another claim) is
        aborted in the engine and its result is never stored."""
        settings = self.settings.worker
        while not self._heartbeat_stop.wait(settings.cancel_poll_interval_s):
            with self._running_lock:
                leases = [(job_id, token) for job_id, (token, _) in self._leases.items()]
            if not leases:
                continue
            try:
                with self.session_factory.begin() as session, watchdog(session, self._watchdog_s):
                    renewed = claims.renew_leases(session, leases, worker=self._worker_name, lease_s=settings.lease_s)
            except Exception as exc:  # the next round tries again; the lease has slack for it
                if not is_transient(exc):
                    logger.exception("cannot renew leases")
                else:
                    logger.warning("cannot renew leases: %s", first_line(exc))
                continue
            for job_id, _ in leases:
                if job_id not in renewed:
                    self.lease_lost(job_id)

    def lease_lost(self, job_id) -> None:
        """The job was cancelled or its lease taken: abort its run (now, or as soon as it is
        submitted); :meth:`run` then raises :class:`JobCancelled`."""
        with self._running_lock:
            if job_id not in self._leases:
                return
            self._lost.add(job_id)
            future = self._leases[job_id][1]
        if future is not None and future.done():  # it finished as its result was being stored
            return
        logger.warning("job %s: cancelled or its lease lost; aborting it", job_id)
        if future is not None:
            self.front.abort(future)

    @property
    def is_stopping(self) -> bool:
        return self._stopping

    def begin_shutdown(self, grace_s: float) -> None:
        """Warm shutdown has begun: running jobs get ``grace_s`` seconds, then :meth:`abort_running`."""
        if self.engine_failed:  # nothing to wait for: every run fails at once
            grace_s = 0.0
        if self._grace_timer is None:
            self._grace_timer = threading.Timer(grace_s, self.abort_running)
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def abort_running(self) -> None:
        """Stop taking jobs and abort every request :meth:`run` waits for (their blocks are freed);
        those runs raise :class:`EngineStopping`, so their messages go back to the queue."""
        self._stopping = True
        self._grace_over = True
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
            self.front.shutdown(drain=drain and not self.engine_failed)
            logger.info("engine stopped; counters: %s", self.front.stats())
        self._heartbeat_stop.set()
        if self.committer is not None:
            self.committer.close()
            committer = self.committer
            logger.info("database writes: %d operations in %d transactions, %.1f s in the database",
                        committer.num_ops, committer.num_transactions, committer.busy_s)
        self.db_engine.dispose()
        self.metrics.close()

    def _engine_step_failed(self, exc: Exception) -> None:
        """A step failed with a job in flight; past ``WEIR_MAX_ENGINE_FAILURES`` in a row, stop
        taking jobs and make the worker exit with :data:`EXIT_ENGINE_FAILED`."""
        from weir.engine.core import EngineDeadError

        limit = self.settings.worker.max_engine_failures
        dead = isinstance(exc, EngineDeadError)
        if (dead or self.front.consecutive_step_failures >= limit) and not self.engine_failed:
            from celery.worker import state as worker_state

            self.engine_failed = True
            self._stopping = True
            if dead:
                logger.critical("%s: the worker exits with status %d", exc, EXIT_ENGINE_FAILED)
            else:
                logger.critical("engine failed %d steps in a row (%s): the worker exits with status %d",
                                self.front.consecutive_step_failures, exc, EXIT_ENGINE_FAILED)
            worker_state.should_stop = EXIT_ENGINE_FAILED

    def run(self, job: Job, *, timeout_s: Optional[float] = None) -> JobResult:
        """Run one claimed job through the engine and wait for it.

        A job the engine refuses (empty or too long prompt, bad request JSON, a prompt plus
        ``max_tokens`` beyond ``max_model_len``: the producer's checks may have used another
        ``max_model_len``) comes back as a failed result carrying the reason, without running;
        the worker goes on. While it runs, its lease (see
        :meth:`hold`) is renewed every ``WEIR_CANCEL_POLL_INTERVAL_S``.

        Args:
            job: the claimed job row.
            timeout_s: the most seconds the engine may take; default ``WEIR_JOB_TIMEOUT_S``.

        Raises:
            EngineStopping: the engine is shutting down; the job should be redelivered.
            EngineFailed: an engine step failed with the job in flight; it should be redelivered.
            JobTimedOut: past ``timeout_s``; the request was aborted.
            JobCancelled: the job was cancelled or its lease lost; the request was aborted.
        """
        from weir.engine.front import EngineStepError, started_at

        if self._stopping:
            raise EngineStopping("the engine is shutting down", started=False)
        timeout_s = self.settings.worker.job_timeout_s if timeout_s is None else timeout_s
        try:
            request = parse_request(job.request)
            future = self.submit(job, request)
        except EngineStepError as exc:  # the engine core died: not the job's fault
            self._engine_step_failed(exc)
            raise EngineFailed(str(exc)) from exc
        except Exception as exc:  # the job's failure, not the worker's: record it and go on
            return self._failure(job, exc)
        output = self._wait(job, future, timeout_s)
        if isinstance(output, Exception):
            return self._failure(job, output)
        if job.kind == JobKind.CLASSIFY:
            return self._classified(output)
        retry = self.retry_after(request, output)
        if retry is None:
            return self._generated(output, request)
        policy, params = retry
        first_started_at = started_at(future) or time.monotonic()  # set once the engine ran it
        # a policy asks for one more run (a flagged description); it picks the one kept
        try:
            future = self._submit_generate(request, params)
        except EngineStepError as exc:
            self._engine_step_failed(exc)
            raise EngineFailed(str(exc)) from exc
        except Exception as exc:
            return self._failure(job, exc)
        second = self._wait(job, future, max(1e-3, timeout_s - (time.monotonic() - first_started_at)))
        if isinstance(second, Exception):
            return self._failure(job, second)
        return self.kept_result(policy, request, output, second)

    def begin_run(self, job: Job) -> None:
        """A claimed job is about to go to the engine (once per attempt, whatever path delivered
        it): counted in the metrics."""
        self.metrics.job_started(job.kind.value)

    def submit(self, job: Job, request: JobRequest, params: Optional[SamplingParams] = None,
               prompt_token_ids: Optional[list[int]] = None) -> Future:
        """Submit a claimed job's request to the engine (a generation with ``params`` in place of
        its own, when given; ``prompt_token_ids``: its prompt already encoded, as
        ``front.encode_prompts`` makes them); the future gives the engine's output.

        Raises:
            ValueError: the engine refuses it (the job's failure).
            EngineStepError: the engine core is dead.
        """
        if job.kind == JobKind.CLASSIFY:
            return self.front.submit_classify(
                request.engine_prompt() if prompt_token_ids is None else prompt_token_ids, request.labels,
                request.label_texts, request.engine_calibration_prompt(), priority=self._engine_priority(request),
            )
        return self._submit_generate(request, params, prompt_token_ids)

    def retry_after(self, request: JobRequest, output) -> Optional[tuple[Any, SamplingParams]]:
        """The first post-run policy (:data:`weir.jobs.applications.POST_RUN_POLICIES`) that asks
        for one more run of a finished generation, with that run's sampling; None when the output
        stands."""
        for policy in self.post_run_policies:
            params = policy.retry_params(request, output)
            if params is not None:
                return policy, params
        return None

    def kept_result(self, policy: Any, request: GenerateRequest, output, second) -> JobResult:
        """The result of a generation run twice (:meth:`retry_after`): the run ``policy`` picks,
        the tokens of both counted."""
        attempts = [output, second]
        kept = attempts[policy.pick(request, attempts)]
        other = attempts[1] if kept is output else output
        result = self._generated(kept, request)
        return dataclasses.replace(
            result, num_prompt_tokens=result.num_prompt_tokens + len(other.prompt_token_ids),
            num_completion_tokens=result.num_completion_tokens + sum(len(c.token_ids) for c in other.outputs),
            num_cached_tokens=(result.num_cached_tokens or 0) + (other.num_cached_tokens or 0))

    def track(self, job: Job, future: Future) -> bool:
        """Register ``future`` as ``job``'s run in the engine (aborted on a lost lease or at the
        end of the shutdown grace period); aborts it at once, returning False, when the job's
        lease is already lost."""
        with self._running_lock:
            self._running.add(future)
            if job.id in self._leases:
                self._leases[job.id][1] = future
            lost = job.id in self._lost
        if lost:
            self.front.abort(future)
        return not lost

    def untrack(self, future: Future) -> None:
        with self._running_lock:
            self._running.discard(future)

    def is_lost(self, job: Job) -> bool:
        """Whether ``job`` was cancelled or its lease lost while this process held it."""
        with self._running_lock:
            return job.id in self._lost

    def enter_chunk(self) -> bool:
        """Begin a chunk on this thread: False when half the model queue's task threads already
        hold chunks (the others stay free for the per-job messages of the model's queue and
        control queue; interactive jobs have threads of their own). Otherwise wait until fewer than
        :attr:`max_chunks` chunks run (enough to fill the engine's places, and one more; the
        worker claims no more jobs than it can feed), or until the worker stops; then True, and
        :meth:`leave_chunk` must follow."""
        with self._chunk_cv:
            if self._chunk_threads >= self.max_chunk_threads:
                return False
            self._chunk_threads += 1
            while self._num_chunks >= self.max_chunks and not self._stopping:
                self._chunk_cv.wait(0.5)
            self._num_chunks += 1
            return True

    def leave_chunk(self) -> None:
        with self._chunk_cv:
            self._num_chunks -= 1
            self._chunk_threads -= 1
            self._chunk_cv.notify()

    def take_slot(self, timeout_s: float = 0.0) -> bool:
        """One of the worker's chunk slots (requests of chunks in the engine at once), if one is
        free within ``timeout_s`` seconds."""
        return self._chunk_slots.acquire(timeout=timeout_s) if timeout_s > 0 else self._chunk_slots.acquire(False)

    def give_slot(self) -> None:
        self._chunk_slots.release()

    def _submit_generate(self, request: GenerateRequest, params: Optional[SamplingParams] = None,
                         prompt_token_ids: Optional[list[int]] = None) -> Future:
        """Submit a generation (with ``params`` in place of the request's own, when given; its
        prompt encoded here unless ``prompt_token_ids`` is given) whose prompt plus
        ``max_tokens`` fits ``max_model_len``.

        Raises:
            ValueError: it does not fit, or the engine refuses it.
        """
        params = request.sampling_params() if params is None else params
        max_model_len = self.front.max_model_len
        if params.max_tokens > max_model_len:  # no need to tokenize
            raise ValueError(too_long_for_output(0, params.max_tokens, max_model_len))
        if prompt_token_ids is None:
            prompt_token_ids = self.front.encode_prompt(request.engine_prompt())
        # a prompt that alone leaves no room gets the engine's own error
        if len(prompt_token_ids) < max_model_len:
            problem = too_long_for_output(len(prompt_token_ids), params.max_tokens, max_model_len)
            if problem is not None:
                raise ValueError(problem)
        return self.front.submit_generate(prompt_token_ids, params, priority=self._engine_priority(request))

    def _engine_priority(self, request: JobRequest) -> int:
        """The job's priority under ``WEIR_SCHEDULING_POLICY=priority``; 0 (arrival order) under fcfs."""
        return request.priority if self.settings.engine.scheduling_policy == "priority" else 0

    def _wait(self, job: Job, future: Future, timeout_s: float):
        """The future's result, or the request's own error as a value; raises as :meth:`run` says."""
        from weir.engine.front import EngineStepError, result_after_start

        self.track(job, future)
        try:
            try:
                return result_after_start(future, timeout_s)
            except FutureTimeout:
                self.front.abort(future)
                raise JobTimedOut(f"no result after {timeout_s:g}s (WEIR_JOB_TIMEOUT_S); aborted") from None
            except CancelledError:  # aborted: its lease was lost, or the grace period is over
                with self._running_lock:
                    lost = job.id in self._lost
                if lost:
                    raise JobCancelled("cancelled or its lease lost while running; aborted") from None
                raise EngineStopping("the engine is shutting down") from None
            except EngineStepError as exc:
                self._engine_step_failed(exc)
                raise EngineFailed(str(exc)) from exc
            except Exception as exc:
                if self._stopping:
                    raise EngineStopping(str(exc)) from exc
                return exc
        finally:
            self.untrack(future)

    def _failure(self, job: Job, exc: Exception) -> JobResult:
        logger.warning("job %s failed: %s: %s", job.id, type(exc).__name__, exc)
        return JobResult.failure(f"{type(exc).__name__}: {exc}")

    def _generated(self, output, request: GenerateRequest) -> JobResult:
        """A generation's result: every completion, the first one's text in ``output_text``,
        ``parsed`` when the request asked for JSON (see :class:`weir.jobs.db.Job`)."""
        completions = [_completion(c, request.wants_json) for c in output.outputs]
        first = completions[0]
        return JobResult(
            status=JobStatus.SUCCEEDED,
            output_text=first["text"],
            finish_reason=first["finish_reason"],
            completions=completions,
            parsed=first["parsed"],
            prompt_logprobs=None if output.prompt_logprobs is None else [
                None if position is None else _logprob_entries(position) for position in output.prompt_logprobs],
            num_prompt_tokens=len(output.prompt_token_ids),
            num_completion_tokens=sum(c["num_tokens"] for c in completions),
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


def _completion(completion, wants_json: bool) -> dict:
    """One ``CompletionOutput`` as stored in ``jobs.completions``."""
    return {
        "index": completion.index,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "num_tokens": len(completion.token_ids),
        "cumulative_logprob": completion.cumulative_logprob,
        "logprobs": None if completion.logprobs is None else [
            _logprob_entries(position) for position in completion.logprobs],
        "parsed": parse_json_output(completion.text, completion.finish_reason) if wants_json else None,
    }


def _logprob_entries(position) -> list[dict]:
    """One position's ``{token id: Logprob}`` (the sampled token first) as a JSON list."""
    return [{"token_id": token_id, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()]


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
