"""Fingerprints for incremental enrichment: ``product_enrichment.category_fingerprint``,
``description_fingerprint`` and ``attributes_fingerprint``.

Each holds what its field was made from: the catalog job's ``product_fingerprint`` (a hash of the
product's content, the job spec and the model). An incremental ``weir enrich`` (the default, and
the nightly run) skips a product whose fields all carry its current fingerprint. Rows written
before this revision keep nulls, so their products are enriched again once.

The columns are added and dropped in place (``ALTER TABLE``; SQLite 3.35 or later for the drop),
not by copying the table, so the views of revision 0007 stay as they are.

Revision ID: 20261202_0008
Revises: 20261202_0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0008"
down_revision: Union[str, None] = "20261202_0007"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

COLUMNS = ("category_fingerprint", "description_fingerprint", "attributes_fingerprint")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("product_enrichment", sa.Column(name, sa.String(64), nullable=True))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        op.execute(f"ALTER TABLE product_enrichment DROP COLUMN {name}")
