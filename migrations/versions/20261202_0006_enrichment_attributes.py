"""Extracted attributes: ``product_enrichment.attributes`` (JSON) beside category and description.

``attributes`` holds the catalog job's attribute extraction for the product: a JSON object with
every field of the job spec's ``[extract]`` schema (null where the listing does not say), valid
against that schema; null when the extraction was cut by ``max_tokens`` or never ran. Rows
written before this revision keep a null.

Revision ID: 20261202_0006
Revises: 20261202_0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0006"
down_revision: Union[str, None] = "20261202_0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("product_enrichment") as batch:
        batch.add_column(sa.Column("attributes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("product_enrichment") as batch:
        batch.drop_column("attributes")
