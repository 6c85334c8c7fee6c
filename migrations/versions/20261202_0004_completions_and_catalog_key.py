"""Every completion of a job, its parsed JSON, and enrichment rows keyed by catalog.

- ``jobs.completions`` (JSON): all ``n`` completions of a generation, with their logprobs when
  asked; ``jobs.parsed`` (JSON): the output parsed as JSON when the job asked for JSON and it
  finished as ``stop``; ``jobs.prompt_logprobs`` (JSON) when asked.
- ``product_enrichment`` is keyed by ``(catalog, product_id)`` instead of ``product_id`` alone,
  so two catalogs' products of the same id no longer overwrite each other. Existing rows take
  the catalog named in their source batch's metadata (``''`` when it names none).

Downgrade keeps, per product id, only the most recently updated row (the old key allows one).

Revision ID: 20261202_0004
Revises: 20261201_0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0004"
down_revision: Union[str, None] = "20261201_0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("completions", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("parsed", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("prompt_logprobs", sa.JSON(), nullable=True))
    op.add_column("product_enrichment", sa.Column("catalog", sa.String(300), nullable=True))
    catalog_of_batch = ("batches.metadata ->> 'catalog'" if op.get_bind().dialect.name == "postgresql"
                        else "json_extract(batches.metadata, '$.catalog')")
    op.execute(
        "UPDATE product_enrichment SET catalog = COALESCE((SELECT " + catalog_of_batch + " FROM batches "
        "WHERE batches.id = product_enrichment.source_batch_id), '')"
    )
    with op.batch_alter_table("product_enrichment") as batch:
        batch.alter_column("catalog", existing_type=sa.String(300), nullable=False)
        batch.drop_constraint(op.f("pk_product_enrichment"), type_="primary")
        batch.create_primary_key(op.f("pk_product_enrichment"), ["catalog", "product_id"])


def downgrade() -> None:
    op.execute(
        "DELETE FROM product_enrichment WHERE EXISTS (SELECT 1 FROM product_enrichment AS newer "
        "WHERE newer.product_id = product_enrichment.product_id AND (newer.updated_at > product_enrichment.updated_at "
        "OR (newer.updated_at = product_enrichment.updated_at AND newer.catalog > product_enrichment.catalog)))"
    )
    with op.batch_alter_table("product_enrichment") as batch:
        batch.drop_constraint(op.f("pk_product_enrichment"), type_="primary")
        batch.create_primary_key(op.f("pk_product_enrichment"), ["product_id"])
        batch.drop_column("catalog")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prompt_logprobs")
        batch.drop_column("parsed")
        batch.drop_column("completions")
