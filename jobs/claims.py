"""Claims and leases: a worker takes jobs (``queued -> running``, or ``running`` under an
expired lease) with a fencing token and a lease it renews, and gives back the ones it will not
finish. Callers own the session and transaction.

A job changes state only through guarded transitions (``UPDATE .. WHERE status = ..``); concurrent
writers of one job serialize on its row, and only a real transition reports a row back. Claims
never lock the batch row: the counters move by one per transition
(:func:`weir.jobs.counters.count_transitions`). The statements are Core statements compiled once
(measured: ORM bulk operations cost more in per-row bookkeeping than the database work).
"""

from __future__ import annotations

import enum
import functools
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Sequence

from sqlalchemy import select, text, tuple_, update
from sqlalchemy.orm import Session

from weir.jobs.counters import count_transitions
from weir.jobs.db import Batch, BatchStatus, Job, JobKind, JobStatus, utcnow
from weir.jobs.results import as_uuid


_jobs = Job.__table__
_batches = Batch.__table__


class ClaimStatus(str, enum.Enum):
    """What a claim found (see :func:`claim_jobs`)."""

    CLAIMED = "claimed"
    """This caller now holds the job's lease and should run it."""
    HELD = "held"
    """Another claim's lease is live: the job runs elsewhere (a duplicate delivery)."""
    FINISHED = "finished"
    """The job is succeeded, failed or cancelled: nothing to do."""
    GAVE_UP = "gave_up"
    """The job had been started ``max_attempts`` times; it is now ``failed`` with the reason."""
    UNKNOWN = "unknown"
    """No such job (or its batch is still ``validating``)."""


@dataclass(frozen=True)
class Claim:
    """One job's claim. ``job`` (CLAIMED only) is the row as claimed; its ``lease_token`` is the
    lease's fencing token. ``lease_expires_at`` (CLAIMED and HELD) is when the lease runs out."""

    status: ClaimStatus
    job: Optional[Job] = None
    lease_expires_at: Optional[datetime] = None


def not_validating():
    return _jobs.c.batch_id.in_(select(_batches.c.id).where(_batches.c.status != BatchStatus.VALIDATING))


def claim_jobs(
    session: Session,
    job_ids: Sequence[uuid.UUID],
    *,
    worker: Optional[str],
    lease_s: float,
    max_attempts: Optional[int] = None,
) -> dict[uuid.UUID, Claim]:
    """Claim many jobs in one transaction, each as a lease; the batch rows are never locked.

    A job is claimable when it is ``queued``, or ``running`` under a lease that has expired (its
    holder died or lost the database). Claiming sets ``running``, increments ``attempts`` and
    ``lease_token`` (the fencing token every later write of this claim must carry), and stamps
    ``worker``, ``claimed_at`` and ``lease_expires_at = now + lease_s``. Concurrent claims of one
    job serialize on its row: exactly one of them gets it. A claimable job already started
    ``max_attempts`` times is a poison job and ends ``failed`` instead, with its batch's counters.

    Args:
        job_ids: the jobs to claim (duplicates are claimed once).
        worker: the claiming worker's name (``weir.jobs.worker``).
        lease_s: the lease's length in seconds; the holder renews it (:func:`renew_leases`).
        max_attempts: the most starts a job gets; None for no limit.

    Returns:
        One :class:`Claim` per distinct id.
    """
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    now = utcnow()
    claims: dict[uuid.UUID, Claim] = {}
    dialect = session.get_bind().dialect.name
    params = {"ids": _ids_param(ids, dialect), "now": now, "max_attempts": max_attempts}
    if max_attempts is not None:
        gave_up = session.execute(_claim_sql(dialect, "gave_up"), params).all()
        count_transitions(session, [(as_uuid(row[1]), JobStatus.FAILED) for row in gave_up], now)
        claims.update({as_uuid(row[0]): Claim(ClaimStatus.GAVE_UP) for row in gave_up})
    expires = now + timedelta(seconds=lease_s)
    found = session.execute(_claim_sql(dialect, "claim", limited=max_attempts is not None),
                            dict(params, expires=expires, worker=worker)).all()
    claimed = [_claimed_job(row, dialect) for row in found]
    for job in claimed:
        claims[job.id] = Claim(ClaimStatus.CLAIMED, job, expires)
    started = sorted({job.batch_id for job in claimed})
    if started:  # only a batch's first claims find it queued; later ones match no row
        session.execute(_claim_sql(dialect, "start_batches"), {"ids": _ids_param(started, dialect), "now": now})
    rest = [job_id for job_id in ids if job_id not in claims]
    if rest:
        for row in session.execute(_claim_sql(dialect, "rest"), {"ids": _ids_param(rest, dialect)}).all():
            job_id, status, lease_expires_at = as_uuid(row[0]), JobStatus(row[1]), row[2]
            if status.is_finished:
                claims[job_id] = Claim(ClaimStatus.FINISHED)
            else:
                if isinstance(lease_expires_at, str):  # SQLite hands text back
                    lease_expires_at = datetime.fromisoformat(lease_expires_at)
                claims[job_id] = Claim(ClaimStatus.HELD, lease_expires_at=lease_expires_at)
        for job_id in rest:
            claims.setdefault(job_id, Claim(ClaimStatus.UNKNOWN))
    return claims


_CLAIMED_COLUMNS = ("id", "batch_id", "batch_index", "custom_id", "kind", "model", "request", "status",
                    "attempts", "lease_token", "worker", "started_at", "claimed_at")


@functools.lru_cache(maxsize=None)
def _claim_sql(dialect: str, which: str, limited: bool = False) -> Any:
    """The statements of :func:`claim_jobs`, as SQL compiled once (their id sets are one array
    parameter, not an ``IN`` list re-rendered for every size)."""
    in_ids = "= ANY(:ids)" if dialect == "postgresql" else "IN (SELECT value FROM json_each(:ids))"
    claimable = (f"jobs.id {in_ids} AND (jobs.status = 'queued' OR (jobs.status = 'running' AND "
                 "(jobs.lease_expires_at IS NULL OR jobs.lease_expires_at <= :now))) "
                 "AND jobs.batch_id IN (SELECT id FROM batches WHERE status <> 'validating')")
    concat = "'gave up after ' || CAST(attempts AS TEXT) || ' attempts: each one lost its worker or ran out of time'"
    sql = {
        "gave_up": (f"UPDATE jobs SET status = 'failed', error = {concat}, finished_at = :now, "
                    f"lease_expires_at = NULL WHERE {claimable} AND jobs.attempts >= :max_attempts "
                    "RETURNING jobs.id, jobs.batch_id"),
        "claim": ("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_token = lease_token + 1, "
                  "started_at = COALESCE(started_at, :now), claimed_at = :now, lease_expires_at = :expires, "
                  f"worker = :worker WHERE {claimable}"
                  + (" AND jobs.attempts < :max_attempts" if limited else "")
                  + " RETURNING " + ", ".join(f"jobs.{c}" for c in _CLAIMED_COLUMNS)),
        "start_batches": (f"UPDATE batches SET status = 'in_progress', started_at = :now "
                          f"WHERE batches.id {in_ids} AND batches.status = 'queued'"),
        "rest": (f"SELECT jobs.id, jobs.status, jobs.lease_expires_at FROM jobs WHERE jobs.id {in_ids} "
                 "AND jobs.batch_id IN (SELECT id FROM batches WHERE status <> 'validating')"),
    }[which]
    return text(sql)


def _ids_param(ids: Sequence[uuid.UUID], dialect: str) -> Any:
    """A set of ids as :func:`_claim_sql`'s ``:ids``: a uuid array, or SQLite's JSON array of hex."""
    return list(ids) if dialect == "postgresql" else json.dumps([i.hex for i in ids])


def _claimed_job(row: Any, dialect: str) -> Job:
    """A detached ``Job`` from a claim's RETURNING row (readable after the transaction)."""
    values = dict(zip(_CLAIMED_COLUMNS, row))
    values["id"], values["batch_id"] = as_uuid(values["id"]), as_uuid(values["batch_id"])
    values["kind"], values["status"] = JobKind(values["kind"]), JobStatus(values["status"])
    if isinstance(values["request"], str):  # SQLite's JSON and times are text
        values["request"] = json.loads(values["request"])
    for name in ("started_at", "claimed_at"):
        if isinstance(values[name], str):
            values[name] = datetime.fromisoformat(values[name]).replace(tzinfo=timezone.utc)
    return Job(**values)


def renew_leases(
    session: Session, leases: Sequence[tuple[uuid.UUID, int]], *, worker: Optional[str], lease_s: float
) -> set[uuid.UUID]:
    """Extend the leases a worker holds by ``lease_s`` seconds from now, in one statement.

    Args:
        leases: (job id, fencing token) of each job the worker runs.

    Returns:
        The ids whose lease was renewed. A job missing from it was cancelled, finished, or taken by
        another claim after its lease expired: its holder must stop and store nothing.
    """
    if not leases:
        return set()
    jobs = _jobs.c
    stmt = (
        update(_jobs)
        .where(
            tuple_(jobs.id, jobs.lease_token).in_(list(leases)),
            jobs.status == JobStatus.RUNNING,
            jobs.worker == worker if worker is not None else jobs.worker.is_(None),
        )
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        .returning(jobs.id)
    )
    return set(session.execute(stmt).scalars())


def release_jobs(
    session: Session,
    leases: Sequence[tuple[uuid.UUID, int]],
    *,
    republish_at: Optional[datetime] = None,
    refund_attempt: bool = False,
) -> set[uuid.UUID]:
    """Give leases back unfinished: each job still held under its token becomes ``queued`` again,
    so the message that goes back to the queue (or a retry's) can claim it at once. Its
    ``attempts`` keeps the cut-short start unless ``refund_attempt`` (the start failed through no
    fault of the job: an engine step failure). ``published_at`` becomes ``republish_at`` (default
    now), since its message is about to be queued again. ``lease_token`` is never given back.

    Returns:
        The ids released (a job finished or taken by another claim meanwhile is left alone).
    """
    if not leases:
        return set()
    jobs = _jobs.c
    stmt = (
        update(_jobs)
        .where(tuple_(jobs.id, jobs.lease_token).in_(list(leases)), jobs.status == JobStatus.RUNNING)
        .values(status=JobStatus.QUEUED, lease_expires_at=None, published_at=republish_at or utcnow(),
                attempts=jobs.attempts - 1 if refund_attempt else jobs.attempts)
        .returning(jobs.id)
    )
    return set(session.execute(stmt).scalars())


def job_status(session: Session, job_id: uuid.UUID) -> Optional[JobStatus]:
    """The job's current status (None: no such job)."""
    return session.scalar(select(Job.status).where(Job.id == job_id))
