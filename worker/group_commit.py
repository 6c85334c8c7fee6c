"""Group commit: one database transaction for the claims, results and releases of many jobs.

Every task thread of a worker hands its database work to one :class:`GroupCommitter` and waits
for the outcome. The committer has two lanes (claims; results and releases), each one thread:
a lane's thread takes what is pending, waits up to
``WEIR_COMMIT_MAX_WAIT_S`` for more (at most ``WEIR_COMMIT_MAX_JOBS`` operations), and runs them
all in one transaction: the claims as one guarded ``UPDATE``, the results as one guarded upsert
with the applications' rows (their result projections) and one counter update per batch, the releases as one ``UPDATE``.
Only after that transaction has committed does each waiting thread get its answer, so a task
acks its message only once its outcome is stored. Database work per job is then a share of one
transaction instead of two transactions of its own (the group-commit technique of database
logs, applied to the queue's own writes).

Failures:

- A transient error (lost or refused connection, pool timeout, serialization failure, deadlock,
  lock or statement timeout, failover to a read-only server; see :func:`is_transient`) retries
  the whole group with exponential backoff (1, 2, 4, 8, then 10 s) until each operation's own
  deadline, ``WEIR_DB_RETRY_TIMEOUT_S`` after it was submitted; past it that operation raises
  :class:`DatabaseUnavailable` and its message goes back to the queue.
- A non-transient error runs the group's operations one transaction each, so one bad result
  does not fail the rest; the bad operation raises that error.
- Each transaction runs under :class:`weir.jobs.db.watchdog`: a database that stops answering fails
  the transaction after ``WEIR_STATEMENT_TIMEOUT_S`` + 5 s instead of hanging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


from weir.jobs import applications
from weir.jobs.claims import Claim, ClaimStatus, claim_jobs, release_jobs
from weir.jobs.db import Job, watchdog
from weir.jobs.results import JobResult, record_results
from weir.jobs.retry import first_line, is_transient, retry
from weir.worker.metrics import DB_WRITE_LANES

logger = logging.getLogger(__name__)

WATCHDOG_MARGIN_S = 5.0

class GroupGivenUp(Exception):
    """Every operation of a group passed its deadline while the database failed transiently; each
    future already holds its :class:`DatabaseUnavailable`."""


class DatabaseUnavailable(RuntimeError):
    """Transient database errors went on for longer than ``WEIR_DB_RETRY_TIMEOUT_S``."""


class CommitterStopped(RuntimeError):
    """The committer was closed before the operation ran."""


@dataclass
class _Op:
    kind: str  # "claim" | "finish" | "release"
    job_id: uuid.UUID
    deadline: float
    job: Optional[Job] = None
    result: Optional[JobResult] = None
    refund_attempt: bool = False
    future: Future = field(default_factory=Future)


class GroupCommitter:
    """Two threads that write the claims, and the results and releases, of all task threads in
    groups.

    Args:
        session_factory: a SQLAlchemy ``sessionmaker``.
        worker: this worker's name, stored on claims.
        lease_s: the lease a claim takes, seconds.
        max_attempts: a job's most starts (``WEIR_MAX_ATTEMPTS``).
        model_name: the model name the applications' result projections store (a callable:
            known once loaded).
        retry_timeout_s: how long an operation may wait out transient errors.
        statement_timeout_s: the database's statement timeout; the watchdog fires this + 5 s.
        max_jobs: the most operations in one transaction.
        max_wait_s: how long a group waits for more operations after its first, seconds.
        is_stopping: True once the worker's shutdown grace period is over (pending operations
            then fail instead of waiting out a database outage).
        write_latency_s: a histogram labelled by ``lane`` (``claim``, ``finish``; a
            prometheus-client ``Histogram``) that gets each committed transaction's duration,
            seconds; None: none kept.
    """

    def __init__(
        self,
        session_factory: Any,
        *,
        worker: str,
        lease_s: float,
        max_attempts: Optional[int],
        model_name: Callable[[], str],
        retry_timeout_s: float,
        statement_timeout_s: float = 30.0,
        max_jobs: int = 256,
        max_wait_s: float = 0.005,
        is_stopping: Callable[[], bool] = lambda: False,
        write_latency_s: Any = None,
    ) -> None:
        self.session_factory = session_factory
        self.projections = applications.load(applications.RESULT_PROJECTIONS)
        self.worker = worker
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.model_name = model_name
        self.retry_timeout_s = retry_timeout_s
        self.watchdog_s = statement_timeout_s + WATCHDOG_MARGIN_S
        self.max_jobs = max_jobs
        self.max_wait_s = max_wait_s
        self.is_stopping = is_stopping
        self._write_latency_s = None if write_latency_s is None else {
            lane: write_latency_s.labels(lane) for lane in DB_WRITE_LANES}
        self._stats_lock = threading.Lock()
        self.num_transactions = 0
        self.num_ops = 0
        self.busy_s = 0.0
        self._closed = False
        # Two lanes, each one thread and its own transactions: claims, and results with releases.
        # A claim never waits behind a group of results, and the database works on both at once.
        self._queues: dict[str, "queue.Queue[Optional[_Op]]"] = {"claim": queue.Queue(), "finish": queue.Queue()}
        self._threads = [
            threading.Thread(target=self._loop, args=(q,), name=f"weir-group-commit-{lane}", daemon=True)
            for lane, q in self._queues.items()
        ]
        for thread in self._threads:
            thread.start()

    # ---- task-thread side ---------------------------------------------------------------------

    def claim(self, job_id: uuid.UUID) -> Claim:
        """Claim one job as a lease (see :func:`weir.jobs.claims.claim_jobs`); blocks until committed.

        Raises:
            DatabaseUnavailable: transient errors outlasted ``retry_timeout_s``.
            Exception: a non-transient database error.
        """
        return self._submit(_Op("claim", job_id, self._deadline()))

    def finish(self, job: Job, result: JobResult) -> bool:
        """Store a claimed job's outcome (and the applications' rows from it); blocks until committed.

        Returns:
            True when the row took it; False when the claim was stale (the job was cancelled,
            finished, or taken by another claim after this one's lease expired).

        Raises:
            DatabaseUnavailable, Exception: as :meth:`claim`.
        """
        return self._submit(_Op("finish", job.id, self._deadline(), job=job, result=result))

    def release(self, job: Job, *, refund_attempt: bool = False) -> bool:
        """Give a claimed job's lease back unfinished (it becomes ``queued``; see
        :func:`weir.jobs.claims.release_jobs`); blocks until committed. Returns True when it was still
        held under this claim."""
        return self._submit(_Op("release", job.id, self._deadline(), job=job, refund_attempt=refund_attempt))

    def claim_async(self, job_id: uuid.UUID) -> Future:
        """:meth:`claim` without waiting: the future gives the ``Claim`` once committed (or raises
        as :meth:`claim` does). Claims submitted together share one transaction."""
        return self._enqueue(_Op("claim", job_id, self._deadline()))

    def finish_async(self, job: Job, result: JobResult) -> Future:
        """:meth:`finish` without waiting: the future gives its bool once committed."""
        return self._enqueue(_Op("finish", job.id, self._deadline(), job=job, result=result))

    def release_async(self, job: Job, *, refund_attempt: bool = False) -> Future:
        """:meth:`release` without waiting."""
        return self._enqueue(_Op("release", job.id, self._deadline(), job=job, refund_attempt=refund_attempt))

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is pending, then stop the thread; later calls raise :class:`CommitterStopped`."""
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    def _deadline(self) -> float:
        return time.monotonic() + self.retry_timeout_s

    def _enqueue(self, op: _Op) -> Future:
        if self._closed:
            raise CommitterStopped("the worker's database writer is closed")
        self._queues["claim" if op.kind == "claim" else "finish"].put(op)
        return op.future

    def _submit(self, op: _Op) -> Any:
        return self._enqueue(op).result()

    # ---- committer thread ---------------------------------------------------------------------

    def _loop(self, ops: "queue.Queue[Optional[_Op]]") -> None:
        stop = False
        while not stop:
            first = ops.get()
            if first is None:
                stop = True
                group = []
            else:
                group = [first]
            wait_until = time.monotonic() + self.max_wait_s
            while len(group) < self.max_jobs:
                try:
                    timeout = wait_until - time.monotonic()
                    op = ops.get(timeout=timeout) if timeout > 0 else ops.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    stop = True
                    break
                group.append(op)
            if group:
                self._run_group(group)
        while True:  # closed: fail whatever arrived after the last group
            try:
                op = ops.get_nowait()
            except queue.Empty:
                return
            if op is not None:
                op.future.set_exception(CommitterStopped("the worker's database writer is closed"))

    def _run_group(self, group: list[_Op]) -> None:
        pending = list(group)  # the operations still waiting; an operation past its deadline leaves

        def give_up(exc: BaseException, num_tries: int, wait_s: float) -> BaseException | None:
            now = time.monotonic()
            for op in list(pending):
                if now + wait_s > op.deadline or self.is_stopping():
                    op.future.set_exception(DatabaseUnavailable(
                        f"job {op.job_id}: {op.kind}: database unreachable for "
                        f"{self.retry_timeout_s:g}s: {first_line(exc)}"))
                    pending.remove(op)
            if not pending:
                return GroupGivenUp()
            logger.warning("transient database error, %d writes retried in %ds (try %d): %s",
                           len(pending), wait_s, num_tries + 1, first_line(exc))
            return None

        try:
            answers = retry(lambda: self._transaction(pending), retryable=is_transient, give_up=give_up,
                            sleep=time.sleep)
        except GroupGivenUp:
            return
        except Exception as exc:
            if len(pending) == 1:
                pending[0].future.set_exception(exc)
            else:
                logger.warning("a group of %d writes failed (%s); writing them one by one",
                               len(pending), first_line(exc))
                for op in pending:
                    self._run_group([op])
            return
        for op, answer in zip(pending, answers):
            op.future.set_result(answer)

    def _transaction(self, group: list[_Op]) -> list[Any]:
        """Run one group in one transaction; the answers in the group's order."""
        started = time.monotonic()
        answers = self._write(group)
        elapsed_s = time.monotonic() - started
        with self._stats_lock:
            self.busy_s += elapsed_s
            self.num_transactions += 1
            self.num_ops += len(group)
        if self._write_latency_s is not None:  # a lane's groups are all claims, or all results and releases
            self._write_latency_s["claim" if group[0].kind == "claim" else "finish"].observe(elapsed_s)
        return answers

    def _write(self, group: list[_Op]) -> list[Any]:
        finishes = [op for op in group if op.kind == "finish"]
        releases = [op for op in group if op.kind == "release"]
        claims = [op for op in group if op.kind == "claim"]
        with self.session_factory.begin() as session, watchdog(session, self.watchdog_s):
            written: set[uuid.UUID] = set()
            if finishes:
                pairs = [(op.job, op.result) for op in finishes]
                written = record_results(session, pairs)
                for project in self.projections.values():  # the applications' rows, same transaction
                    project(session, [p for p in pairs if p[0].id in written], model=self.model_name())
            released = set()
            for refund in (False, True):
                leases = [(op.job.id, op.job.lease_token) for op in releases if op.refund_attempt == refund]
                released |= release_jobs(session, leases, refund_attempt=refund)
            claimed = claim_jobs(session, [op.job_id for op in claims], worker=self.worker,
                                 lease_s=self.lease_s, max_attempts=self.max_attempts)
        answers = []
        handed: set[uuid.UUID] = set()
        for op in group:
            if op.kind == "finish":
                answers.append(op.job_id in written)
            elif op.kind == "release":
                answers.append(op.job_id in released)
            else:
                claim = claimed[op.job_id]
                if claim.status == ClaimStatus.CLAIMED and op.job_id in handed:
                    # two deliveries of one job in one group: the first runs it, the other finds
                    # it held under that claim's lease, as it would one group later
                    claim = Claim(ClaimStatus.HELD, lease_expires_at=claim.lease_expires_at)
                handed.add(op.job_id)
                answers.append(claim)
        return answers
