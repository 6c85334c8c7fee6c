"""One delivery of a ``run_chunk`` message: the jobs of a bulk batch, many to a message.

A bulk batch (priority above 0) is published as one message per ``WEIR_CHUNK_SIZE`` job ids.
The task thread that takes one claims all its jobs together (their claims share one group-commit
transaction), feeds them to the engine as the worker's chunk slots free (at most
``CHUNK_SLOTS_PER_SEQ * max_num_seqs`` chunk requests in the engine at once), and hands each
outcome to group commit the moment its request finishes. One thread per chunk, none per job.

Ack rule: the message is acked once every job of the chunk has a stored outcome (or is known to
run elsewhere), as for a single job's message (``acks_late``). A worker that dies mid-chunk leaves
the message unacked; on its redelivery the jobs already stored are skipped by their claims, and
the jobs a previous delivery started but did not finish are each published again as a
``run_job`` message of their own, so a poison job among them crashes only its own attempts and
the per-job guarantees (``WEIR_MAX_ATTEMPTS``, timeouts, dead letters) apply to each. Per job,
as for ``run_job``:

- a job held under another claim's live lease, or timed out with attempts left, is published
  again alone (after the lease would expire, or the timeout's backoff);
- cancel, a lost lease, and a stale fencing token abort the job's request and store nothing;
- an engine failure, the end of the shutdown grace period, or a database that stays unreachable
  puts the whole message back on the queue (``REQUEUE``), the engine's jobs released with their
  start given back.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional

from celery.utils.time import get_exponential_backoff_interval

from weir.jobs.claims import ClaimStatus
from weir.jobs.db import Job, JobKind, JobStatus
from weir.jobs.results import JobResult
from weir.jobs.schemas import parse_request
from weir.worker.attempt import MalformedMessage, Outcome, held_wait_s, release_lease, with_db_retry
from weir.worker.group_commit import DatabaseUnavailable
from weir.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a chunk's thread looks at its jobs' deadlines while it waits."""


@dataclass
class ChunkAttempt:
    """What became of one delivery of a chunk.

    ``outcome``: ``DONE`` (ack) or ``REQUEUE`` (the message goes back to the queue).
    ``republish``: (job id, countdown in seconds) to publish again as ``run_job`` messages
    before the message is acked. ``counts``: how many jobs ended each way (for the log).
    """

    outcome: Outcome
    reason: str = ""
    republish: list[tuple[uuid.UUID, float]] = field(default_factory=list)
    counts: collections.Counter = field(default_factory=collections.Counter)


def parse_job_ids(args: tuple, kwargs: dict) -> list[uuid.UUID]:
    """The job ids of a ``run_chunk`` message, whose arguments are one or more UUID strings.

    Raises:
        MalformedMessage: keyword arguments, no argument, or one that is not a UUID string.
    """
    if kwargs or not args:
        raise MalformedMessage(f"run_chunk takes args [job_id, ...], got args {list(args)!r} kwargs {kwargs!r}")
    ids = []
    for arg in args:
        if not isinstance(arg, str):
            raise MalformedMessage(f"job id must be a UUID string, got {type(arg).__name__} {arg!r}")
        try:
            ids.append(uuid.UUID(arg))
        except ValueError:
            raise MalformedMessage(f"job id {arg!r} is not a UUID") from None
    return ids


def _started_before(runtime: WorkerRuntime, job_ids: list[uuid.UUID]) -> tuple[list[uuid.UUID], bool]:
    """(the unfinished jobs among ``job_ids``, whether any of them was started before)."""
    from sqlalchemy import select

    def read():
        with runtime.session_factory() as session:
            return session.execute(select(Job.id, Job.status, Job.attempts).where(Job.id.in_(job_ids))).all()

    rows = with_db_retry(runtime, "chunk", read)
    unfinished = [r.id for r in rows if r.status in (JobStatus.QUEUED, JobStatus.RUNNING)]
    return unfinished, any(r.attempts > 0 for r in rows if r.id in set(unfinished))


def run_chunk_attempt(runtime: WorkerRuntime, job_ids: list[uuid.UUID], *, worker: str) -> ChunkAttempt:
    """Claim, run and store the jobs of one chunk; see the module docstring.

    Raises:
        Exception: a non-transient database error while reading or claiming (the task publishes
            the message again after a backoff, as ``run_job`` does); claims already taken are
            given back first.
    """
    try:
        unfinished, started = _started_before(runtime, job_ids)
    except DatabaseUnavailable as exc:
        return ChunkAttempt(Outcome.REQUEUE, str(exc))
    if started:  # a worker died in it, or a job timed out: each unfinished job goes alone
        return ChunkAttempt(Outcome.DONE, f"{len(unfinished)} unfinished jobs published again one by one "
                            "(a delivery of this chunk started them before)",
                            republish=[(j, 0.0) for j in unfinished])
    if runtime.is_stopping:
        return ChunkAttempt(Outcome.REQUEUE, "engine stopping")
    writer = runtime.writer(worker)
    futures = [writer.claim_async(j) for j in unfinished]
    claims, error = [], None
    for future in futures:
        try:
            claims.append(future.result())
        except Exception as exc:  # the same group's claims fail together; give back the others
            error = exc
    claimed = [c.job for c in claims if c.status == ClaimStatus.CLAIMED]
    if error is not None:
        for job in claimed:
            release_lease(writer, job, refund_attempt=True)
        if isinstance(error, DatabaseUnavailable):
            return ChunkAttempt(Outcome.REQUEUE, str(error))
        raise error
    attempt = ChunkAttempt(Outcome.DONE)
    if len(unfinished) < len(job_ids):
        attempt.counts["finished or unknown"] += len(job_ids) - len(unfinished)
    for claim in claims:
        if claim.status == ClaimStatus.HELD:  # a duplicate delivery: it runs elsewhere
            attempt.republish.append((claim.job_id, held_wait_s(claim, runtime.settings.worker.lease_s)))
            attempt.counts["held elsewhere"] += 1
        elif claim.status != ClaimStatus.CLAIMED:
            attempt.counts[f"nothing to run ({claim.status.value})"] += 1
    _ChunkRun(runtime, writer, claimed, attempt).run()
    if attempt.outcome == Outcome.DONE:
        attempt.reason = ", ".join(f"{n} {what}" for what, n in sorted(attempt.counts.items()))
    return attempt


@dataclass
class _Run:
    """One claimed job of the chunk while its request is in the engine."""

    job: Job
    request: Any
    claimed_at: float
    started_at: Optional[float] = None  # when the engine first scheduled its (first) request
    first: Any = None  # the first output of a generation a post-run policy runs once more
    policy: Any = None  # that policy (it picks the run kept)
    timed_out: bool = False


class _ChunkRun:
    """The loop of one chunk's thread: feed the engine, collect outputs, store outcomes."""

    def __init__(self, runtime: WorkerRuntime, writer: Any, jobs: list[Job], attempt: ChunkAttempt):
        self.runtime = runtime
        self.writer = writer
        self.waiting = collections.deque(jobs)
        self.attempt = attempt
        self.in_engine: dict[Future, _Run] = {}
        self.storing: dict[Future, tuple[Job, JobResult, float]] = {}
        self.timeout_s = runtime.settings.worker.job_timeout_s
        self.max_attempts = runtime.settings.worker.max_attempts
        for job in jobs:
            runtime.hold(job)  # leases renewed from now on, with every other job of this process
        self.requests: dict[uuid.UUID, Any] = {}
        self.prompt_token_ids: dict[uuid.UUID, list[int]] = {}

    def _prepare(self) -> None:
        """Parse the jobs' requests and encode all their prompts in one tokenizer call (a job
        whose request does not parse, or a chunk with a prompt the batch call refuses, is
        parsed and encoded alone when fed, and fails there with its own error)."""
        for job in self.waiting:
            try:
                self.requests[job.id] = parse_request(job.request)
            except Exception:
                continue
        try:
            encoded = self.runtime.front.encode_prompts([r.engine_prompt() for r in self.requests.values()])
        except Exception:
            return
        self.prompt_token_ids = dict(zip(self.requests, encoded))

    def run(self) -> None:
        self._prepare()
        try:
            while self.waiting or self.in_engine or self.storing:
                self._feed()
                pending = [*self.in_engine, *self.storing]
                # nothing pending: every slot of the worker was taken by other chunks (_feed waited)
                if pending:
                    wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                # done() also holds for a cancelled future, which wait() does not report
                done = [f for f in pending if f.done()]
                for future in done:
                    if future in self.in_engine:
                        self._engine_done(future)
                    else:
                        self._stored(future)
                self._check_deadlines()
        finally:
            for run in self.in_engine.values():  # only on an unexpected error: nothing left behind
                self.runtime.drop(run.job)

    # ---- feeding the engine ----------------------------------------------------------------------

    def _feed(self) -> None:
        runtime = self.runtime
        while self.waiting:
            if self.attempt.outcome == Outcome.REQUEUE or runtime.is_stopping:
                self._give_back_waiting()
                return
            # a chunk with nothing else to wait for blocks on a slot; otherwise it only takes free ones
            if not runtime.take_slot(0.0 if self.in_engine or self.storing else POLL_S):
                return
            job = self.waiting.popleft()
            if runtime.is_lost(job):  # cancelled (or its lease taken) while it waited: never runs
                runtime.give_slot()
                runtime.drop(job)
                self.attempt.counts["cancelled or lease lost"] += 1
                continue
            now = time.monotonic()
            try:
                runtime.begin_run(job)
                request = self.requests.pop(job.id, None) or parse_request(job.request)
                future = runtime.submit(job, request, prompt_token_ids=self.prompt_token_ids.pop(job.id, None))
            except Exception as exc:
                runtime.give_slot()
                self._submit_failed(job, now, exc)
                continue
            self._track(future, _Run(job, request, now))

    def _track(self, future: Future, run: _Run) -> None:
        self.in_engine[future] = run
        self.runtime.track(run.job, future)

    def _submit_failed(self, job: Job, claimed_at: float, exc: Exception) -> None:
        from weir.engine.front import EngineStepError

        if isinstance(exc, EngineStepError):  # the engine core died: not the job's fault
            self.runtime._engine_step_failed(exc)
            self._requeue(job, f"engine step failed: {exc}")
        else:
            self._store(job, self.runtime._failure(job, exc), claimed_at)

    def _give_back_waiting(self) -> None:
        while self.waiting:
            self._requeue(self.waiting.popleft(), "engine stopping")

    # ---- outputs ------------------------------------------------------------------------------------

    def _engine_done(self, future: Future) -> None:
        from weir.engine.front import EngineStepError, started_at

        runtime = self.runtime
        run = self.in_engine.pop(future)
        runtime.untrack(future)
        job = run.job
        try:
            output = future.result(timeout=0)
        except CancelledError:
            runtime.give_slot()
            if runtime.is_lost(job):
                self.attempt.counts["cancelled or lease lost"] += 1
                runtime.drop(job)
            elif run.timed_out:
                self._timed_out(run)
            else:  # the shutdown grace period is over: a start that counts
                self._requeue(job, "engine stopping", refund=False)
            return
        except EngineStepError as exc:
            runtime.give_slot()
            runtime._engine_step_failed(exc)
            self._requeue(job, f"engine step failed: {exc}")
            return
        except Exception as exc:
            runtime.give_slot()
            if runtime.is_stopping:
                self._requeue(job, f"engine stopping: {exc}", refund=False)
            else:
                self._store(job, runtime._failure(job, exc), run.claimed_at)
            return
        if job.kind == JobKind.CLASSIFY:
            runtime.give_slot()
            self._store(job, runtime._classified(output), run.claimed_at)
            return
        if run.first is not None:
            runtime.give_slot()
            self._store(job, runtime.kept_result(run.policy, run.request, run.first, output), run.claimed_at)
            return
        retry = runtime.retry_after(run.request, output)
        if retry is None:
            runtime.give_slot()
            self._store(job, runtime._generated(output, run.request), run.claimed_at)
            return
        try:  # a policy asks for one more run (a flagged description), in the same slot
            second = runtime.submit(job, run.request, retry[1])
        except Exception as exc:
            runtime.give_slot()
            self._submit_failed(job, run.claimed_at, exc)
            return
        run.first, run.policy = output, retry[0]
        if run.started_at is None:  # the first request ran between two deadline checks
            run.started_at = started_at(future)
        self._track(second, run)

    def _check_deadlines(self) -> None:
        from weir.engine.front import started_at

        now = time.monotonic()
        for future, run in list(self.in_engine.items()):
            if run.started_at is None:  # a second run keeps the first one's start
                run.started_at = started_at(future)
            if not run.timed_out and run.started_at is not None and now > run.started_at + self.timeout_s:
                run.timed_out = True
                self.runtime.front.abort(future)

    def _timed_out(self, run: _Run) -> None:
        job = run.job
        why = f"no result after {self.timeout_s:g}s (WEIR_JOB_TIMEOUT_S); aborted"
        if job.attempts < self.max_attempts:
            release_lease(self.writer, job)
            self.runtime.drop(job)
            countdown = get_exponential_backoff_interval(1, job.attempts, 60)
            logger.warning("job %s: %s; published again alone in %ds", job.id, why, countdown)
            self.attempt.republish.append((job.id, countdown))
            self.attempt.counts["timed out, published again"] += 1
            return
        self._store(job, JobResult.failure(f"JobTimedOut: {why} on each of {job.attempts} attempts"), run.claimed_at)

    # ---- storing --------------------------------------------------------------------------------------

    def _store(self, job: Job, result: JobResult, claimed_at: float) -> None:
        try:
            future = self.writer.finish_async(job, result)
        except Exception as exc:  # the writer is closed: the worker is going down
            self._requeue(job, f"result not stored: {exc}", release=False)
            return
        self.storing[future] = (job, result, claimed_at)

    def _stored(self, future: Future) -> None:
        job, result, claimed_at = self.storing.pop(future)
        runtime = self.runtime
        try:
            took = future.result(timeout=0)
        except DatabaseUnavailable as exc:
            self._requeue(job, str(exc), release=False)
            return
        except Exception as exc:  # refused for good: a failure naming why, so the job never stays running
            if result.status == JobStatus.FAILED and (result.error or "").startswith("result not stored"):
                self._requeue(job, f"result not stored: {exc}", release=False)
                return
            logger.exception("job %s: the database refused its result", job.id)
            text = str(exc).splitlines()[0] if str(exc) else ""
            self._store(job, JobResult.failure(f"result not stored: {type(exc).__name__}: {text}"), claimed_at)
            return
        runtime.drop(job)
        if not took:
            self.attempt.counts["result dropped (stale claim)"] += 1
            return
        runtime.metrics.job_finished(job.kind.value, result.status.value, time.monotonic() - claimed_at)
        self.attempt.counts[result.status.value] += 1

    def _requeue(self, job: Job, why: str, *, refund: bool = True, release: bool = True) -> None:
        """The job goes back with the whole message, its lease given back (``refund``: its start
        not counted, for an engine failure or a start that never reached the engine)."""
        if release:
            release_lease(self.writer, job, refund_attempt=refund)
        self.runtime.drop(job)
        self.attempt.outcome = Outcome.REQUEUE
        self.attempt.reason = why
        self.attempt.counts["back to the queue"] += 1
