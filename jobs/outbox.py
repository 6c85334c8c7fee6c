"""The publish side of a stored job (a transactional outbox): ``published_at`` is stamped when its
message went to the broker; the sweeper takes the jobs left unpublished (a producer that died
between the commit and the publish, a broker down) and publishes them in order.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Optional, Sequence

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from weir.jobs.claims import not_validating
from weir.jobs.db import Job, JobStatus, utcnow


def stamp_published(
    session: Session, batch_id: uuid.UUID, first_index: int, num_jobs: int, when: Optional[datetime]
) -> list[uuid.UUID]:
    """Set ``published_at`` to ``when`` for the batch's jobs of batch index ``first_index`` to
    ``first_index + num_jobs - 1`` (not committed); the batch is published page by page this way.

    Returns:
        Their ids in batch-index order.
    """
    stmt = (
        update(Job)
        .where(Job.batch_id == batch_id, Job.batch_index >= first_index, Job.batch_index < first_index + num_jobs)
        .values(published_at=when)
        .returning(Job.batch_index, Job.id)
        .execution_options(synchronize_session=False)
    )
    return [job_id for _, job_id in sorted(session.execute(stmt).all())]


def take_jobs_to_publish(
    session: Session,
    *,
    model: str,
    older_than: datetime,
    limit: int = 1000,
    queued_before: Optional[datetime] = None,
    queued_before_job: Optional[tuple[uuid.UUID, int]] = None,
) -> list[uuid.UUID]:
    """Find jobs whose message is missing and stamp them published now (the sweeper's read).

    Taken, of batches no longer ``validating``:

    - ``queued`` jobs never published (``published_at`` null: a publish failed), at once;
    - ``running`` jobs whose lease expired before ``older_than`` and that were not published since
      it expired (their worker died; Redis may have lost or may still hold their message);
    - ``queued`` jobs last published before ``queued_before``: the caller passes the publish time
      of the oldest message still waiting in the queue (less a grace), before which every message
      has been taken from the queue, so such a job's message is lost; or ``older_than`` when the
      queue is empty. None takes none of these. ``queued_before_job`` (batch id, index) also
      takes the jobs of that batch published at exactly ``queued_before`` with a lower index (one
      publish sends a batch's messages in index order under one time).

    Rows are taken with ``FOR UPDATE SKIP LOCKED``, so two sweepers never take the same job.

    Returns:
        The ids, oldest publish first, now with ``published_at`` = now (not committed).
    """
    lost = [
        and_(Job.status == JobStatus.QUEUED, Job.published_at.is_(None)),
        and_(Job.status == JobStatus.RUNNING, Job.lease_expires_at < older_than,
             or_(Job.published_at.is_(None), Job.published_at < Job.lease_expires_at)),
    ]
    if queued_before is not None:
        before = Job.published_at < queued_before
        if queued_before_job is not None:
            batch_id, index = queued_before_job
            before = or_(before, and_(Job.published_at == queued_before, Job.batch_id == batch_id,
                                      Job.batch_index < index))
        lost.append(and_(Job.status == JobStatus.QUEUED, before))
    stmt = (
        select(Job.id)
        .where(Job.model == model, or_(*lost), not_validating())
        # The order they are published in again: a batch's jobs by index (see ``queued_before_job``).
        .order_by(Job.published_at.asc().nulls_first(), Job.batch_id, Job.batch_index)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = list(session.execute(stmt).scalars())
    if ids:
        mark_published(session, ids, utcnow())
    return ids


def publish_position(session: Session, job_id: uuid.UUID) -> Optional[tuple[datetime, uuid.UUID, int]]:
    """(``published_at``, batch id, batch index) of a job (None: never published, or no such job)."""
    row = session.execute(select(Job.published_at, Job.batch_id, Job.batch_index).where(Job.id == job_id)).first()
    return None if row is None or row[0] is None else (row[0], row[1], row[2])


def mark_published(session: Session, job_ids: Sequence[uuid.UUID], when: Optional[datetime]) -> None:
    """Set ``published_at`` of the jobs to ``when`` (None: not published, sweep at once)."""
    session.execute(
        update(Job)
        .where(Job.id.in_(list(job_ids)))
        .values(published_at=when)
        .execution_options(synchronize_session=False)
    )
