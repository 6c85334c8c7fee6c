"""Delivery guarantees: who claimed a job and when, when it was last published, dead letters.

``weir.jobs.worker`` and ``weir.jobs.claimed_at`` record the latest claim (the sweeper finds running jobs
whose worker is gone by ``claimed_at``); ``weir.jobs.published_at`` is the latest publish of the job's
message (null: never published, the sweeper publishes it at once). ``dead_letters`` keeps every
queue message the worker could not read, with the reason.

Revision ID: 20261130_0002
Revises: 20261130_0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261130_0002"
down_revision: Union[str, None] = "20261130_0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("worker", sa.String(200), nullable=True))
        batch.add_column(sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))
    # Rows enqueued before this revision were published when they were queued.
    op.execute("UPDATE jobs SET published_at = queued_at, claimed_at = started_at")
    op.create_index("ix_jobs_status_published_at", "jobs", ["status", "published_at"])
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("queue", sa.String(200), nullable=True),
        sa.Column("task", sa.String(200), nullable=True),
        sa.Column("message_id", sa.String(200), nullable=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
    op.drop_index("ix_jobs_status_published_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("published_at")
        batch.drop_column("claimed_at")
        batch.drop_column("worker")
