"""Leases, transactional batch counters, nightly slots, enrichment ordering, a validating state.

- ``weir.jobs.lease_expires_at``, ``weir.jobs.lease_token``: a claim is a lease held by ``weir.jobs.worker``
  until this time; ``lease_token`` grows by one with every claim and is the claim's fencing token
  (a write carrying an older token changes nothing).
- ``batches.idempotency_key``: unique; one batch per catalog per scheduled slot.
- ``batches.status`` gains ``validating`` (a batch still being stored; no message is published
  for it yet).
- ``product_enrichment.source_batch_created_at``: an enrichment row is only ever overwritten by a
  result of a batch created at the same time or later.
- Indexes: ``(batch_id, batch_index)`` unique (results in submission order), ``(status,
  lease_expires_at)`` (expired leases). Lookups by product id use ``product_enrichment``'s key.

The batch counters themselves are unchanged columns; from this revision on they move in the same
transaction as each job's state change instead of being recounted.

Revision ID: 20261201_0003
Revises: 20261130_0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0003"
down_revision: Union[str, None] = "20261130_0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

OLD_BATCH_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
NEW_BATCH_STATUSES = ("validating",) + OLD_BATCH_STATUSES


def _one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("lease_token", sa.Integer(), nullable=False, server_default="0"))
        batch.create_unique_constraint(op.f("uq_jobs_batch_id_batch_index"), ["batch_id", "batch_index"])
    op.create_index("ix_jobs_status_lease_expires_at", "jobs", ["status", "lease_expires_at"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(300), nullable=True))
        batch.create_unique_constraint(op.f("uq_batches_idempotency_key"), ["idempotency_key"])
        batch.drop_constraint(op.f("ck_batches_batch_status"), type_="check")
        batch.create_check_constraint("batch_status", _one_of("status", NEW_BATCH_STATUSES))
    with op.batch_alter_table("product_enrichment") as batch:
        batch.add_column(sa.Column("source_batch_created_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("product_enrichment") as batch:
        batch.drop_column("source_batch_created_at")
    op.execute("DELETE FROM batches WHERE status = 'validating'")
    with op.batch_alter_table("batches") as batch:
        batch.drop_constraint(op.f("ck_batches_batch_status"), type_="check")
        batch.create_check_constraint("batch_status", _one_of("status", OLD_BATCH_STATUSES))
        batch.drop_constraint(op.f("uq_batches_idempotency_key"), type_="unique")
        batch.drop_column("idempotency_key")
    op.drop_index("ix_jobs_status_lease_expires_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("uq_jobs_batch_id_batch_index"), type_="unique")
        batch.drop_column("lease_token")
        batch.drop_column("lease_expires_at")
