"""A batch's counters (``num_running``, ``num_succeeded`` ...): each real job transition moves them
by one in the same transaction (one ``UPDATE batches SET num_x = num_x + k`` per batch per
transaction, last before the commit), so they never drift and never need a recount, and the
transaction that brings them to ``num_jobs`` finishes the batch, exactly once.
:func:`reconcile_batches` recounts from ``jobs`` and repairs (the rare check).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Optional, Sequence

from sqlalchemy import and_, case, func, select, update
from sqlalchemy.orm import Session

from weir.jobs.db import Batch, BatchStatus, Job, JobStatus, utcnow


_batches = Batch.__table__


def count_transitions(session: Session, transitions: Sequence[tuple[uuid.UUID, JobStatus]], now: datetime) -> None:
    """Move each batch's counters by its jobs' real transitions to a final status, one guarded
    ``UPDATE`` per batch (in id order, so two writers never deadlock), and finish a batch whose
    counts reach ``num_jobs``. The batch row is locked only from this statement to the commit."""
    deltas: dict[uuid.UUID, Counter] = {}
    for batch_id, status in transitions:
        deltas.setdefault(batch_id, Counter())[status] += 1
    for batch_id in sorted(deltas):
        delta = deltas[batch_id]
        succeeded, failed, cancelled = (delta[JobStatus.SUCCEEDED], delta[JobStatus.FAILED],
                                        delta[JobStatus.CANCELLED])
        batches = _batches.c
        finished = and_(
            batches.status.in_([BatchStatus.QUEUED, BatchStatus.IN_PROGRESS]),
            batches.num_succeeded + batches.num_failed + batches.num_cancelled + (succeeded + failed + cancelled)
            >= batches.num_jobs,
        )
        final = case((batches.num_failed + failed >= batches.num_jobs, BatchStatus.FAILED.value),
                     else_=BatchStatus.COMPLETED.value)
        session.execute(
            update(_batches)
            .where(batches.id == batch_id)
            .values(
                num_succeeded=batches.num_succeeded + succeeded,
                num_failed=batches.num_failed + failed,
                num_cancelled=batches.num_cancelled + cancelled,
                status=case((finished, final), else_=batches.status),
                finished_at=case((finished, now), else_=batches.finished_at),
            )
        )


@dataclass(frozen=True)
class Reconciled:
    """A batch whose stored counters differed from a recount: before and after."""

    batch_id: uuid.UUID
    before: tuple[int, int, int, str]
    after: tuple[int, int, int, str]


def reconcile_batches(session: Session, batch_ids: Optional[Sequence[uuid.UUID]] = None) -> list[Reconciled]:
    """Recount batches from ``jobs`` and repair counters or status that differ (the rare check;
    the counters move transactionally, so a difference means a row was changed by hand).

    Each batch is recounted under its row lock. A batch whose counts reach ``num_jobs`` is
    finished as :func:`record_results` would have finished it.

    Args:
        batch_ids: the batches to check; None checks every batch not yet finished.

    Returns:
        The batches that were repaired.
    """
    if batch_ids is None:
        batch_ids = list(session.execute(
            select(Batch.id).where(Batch.status.in_([BatchStatus.QUEUED, BatchStatus.IN_PROGRESS]))
        ).scalars())
    repaired = []
    for batch_id in sorted(batch_ids):
        batch = session.execute(
            select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
        ).scalar_one_or_none()
        if batch is None or batch.status == BatchStatus.VALIDATING:
            continue
        counts = dict(session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
        ).all())
        before = (batch.num_succeeded, batch.num_failed, batch.num_cancelled, batch.status.value)
        batch.num_succeeded = counts.get(JobStatus.SUCCEEDED, 0)
        batch.num_failed = counts.get(JobStatus.FAILED, 0)
        batch.num_cancelled = counts.get(JobStatus.CANCELLED, 0)
        if batch.num_succeeded + batch.num_failed + batch.num_cancelled >= batch.num_jobs and not batch.status.is_finished:
            all_failed = batch.num_jobs > 0 and batch.num_failed == batch.num_jobs
            batch.status = BatchStatus.FAILED if all_failed else BatchStatus.COMPLETED
            batch.finished_at = utcnow()
        after = (batch.num_succeeded, batch.num_failed, batch.num_cancelled, batch.status.value)
        if after != before:
            repaired.append(Reconciled(batch_id, before, after))
    session.flush()
    return repaired
