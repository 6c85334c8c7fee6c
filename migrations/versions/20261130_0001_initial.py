"""Initial schema: batches, jobs, product_enrichment.

Revision ID: 20261130_0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261130_0001"
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

BATCH_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
JOB_KINDS = ("generate", "classify")


def _one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("num_jobs", sa.Integer(), nullable=False),
        sa.Column("num_succeeded", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("num_cancelled", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.CheckConstraint(_one_of("status", BATCH_STATUSES), name=op.f("ck_batches_batch_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("batch_id", sa.Uuid(), nullable=False),
        sa.Column("batch_index", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("label", sa.Text(), nullable=True),
        sa.Column("label_probs", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("num_completion_tokens", sa.Integer(), nullable=True),
        sa.Column("num_cached_tokens", sa.Integer(), nullable=True),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(_one_of("kind", JOB_KINDS), name=op.f("ck_jobs_job_kind")),
        sa.CheckConstraint(_one_of("status", JOB_STATUSES), name=op.f("ck_jobs_job_status")),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_jobs_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_jobs_batch_id_custom_id")),
    )
    op.create_index("ix_jobs_batch_id_status", "jobs", ["batch_id", "status"])
    op.create_table(
        "product_enrichment",
        sa.Column("product_id", sa.String(64), nullable=False),
        sa.Column("category", sa.Text(), nullable=True),
        sa.Column("category_confidence", sa.Float(), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("source_batch_id", sa.Uuid(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_batch_id"],
            ["batches.id"],
            name=op.f("fk_product_enrichment_source_batch_id_batches"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("product_id", name=op.f("pk_product_enrichment")),
    )


def downgrade() -> None:
    op.drop_table("product_enrichment")
    op.drop_index("ix_jobs_batch_id_status", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("batches")
