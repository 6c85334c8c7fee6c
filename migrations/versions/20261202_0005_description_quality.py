"""Description quality: ``product_enrichment.quality`` beside the generated description.

``quality`` is ``ok`` for a description that ends its sentence and does not loop, else the flags
that apply (``unfinished``, ``repetitive``, ``empty``); see ``weir.jobs.catalog.quality``. Rows written
before this revision keep a null quality (never checked).

Revision ID: 20261202_0005
Revises: 20261202_0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261202_0005"
down_revision: Union[str, None] = "20261202_0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("product_enrichment") as batch:
        batch.add_column(sa.Column("quality", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("product_enrichment") as batch:
        batch.drop_column("quality")
