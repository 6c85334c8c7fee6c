"""A decision per enriched field: ``product_enrichment.category_decision``,
``description_decision``, ``attributes_decision`` (``auto``, ``review`` or ``reject``), each with its
``*_reasons`` (JSON: ``[{"code": ..., "text": ...}]``), ``attributes_confidence`` (attribute -> the
probability of its value's tokens) and ``attributes_wanted`` (the product's job
spec asks for attributes). The view ``latest_enrichment`` shows them, and its ``publishable``
becomes: every field the spec asks for is ``auto`` (category and description, and attributes when
wanted).

Rows written before this revision have no decisions, so they are not publishable until enriched
again (an incremental ``weir enrich`` redoes a field without a decision). The view is dropped and
created again around the column changes (revision 0007 says why); on Postgres its grant to
``weir_reader`` goes with it and is given again. The downgrade restores 0007's view.

Revision ID: 20261205_0010
Revises: 20261205_0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261205_0010"
down_revision: Union[str, None] = "20261205_0009"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

READER_ROLE = "weir_reader"
COLUMNS = (
    ("category_decision", sa.String(16)), ("category_reasons", sa.JSON()),
    ("description_decision", sa.String(16)), ("description_reasons", sa.JSON()),
    ("attributes_decision", sa.String(16)), ("attributes_reasons", sa.JSON()),
    ("attributes_confidence", sa.JSON()), ("attributes_wanted", sa.Boolean()),
)

VIEW = (
    "SELECT catalog, product_id, category, category_confidence, category_decision, category_reasons, "
    "description, quality, description_decision, description_reasons, "
    "COALESCE(category_decision = 'auto', false) AND COALESCE(description_decision = 'auto', false) "
    "AND (COALESCE(attributes_decision = 'auto', false) OR (attributes_decision IS NULL "
    "AND NOT COALESCE(attributes_wanted, false))) AS publishable, "
    "attributes, attributes_decision, attributes_reasons, attributes_confidence, model, source_batch_id, source_batch_created_at, "
    "updated_at FROM product_enrichment"
)
OLD_VIEW = (
    "SELECT catalog, product_id, category, category_confidence, description, quality, "
    "COALESCE(quality = 'ok', false) AS publishable, attributes, model, source_batch_id, "
    "source_batch_created_at, updated_at FROM product_enrichment"
)


def _grant() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN "
                   f"GRANT SELECT ON latest_enrichment TO {READER_ROLE}; END IF; END $$")


def upgrade() -> None:
    op.execute("DROP VIEW latest_enrichment")
    for name, type_ in COLUMNS:
        op.add_column("product_enrichment", sa.Column(name, type_, nullable=True))
    op.execute(f"CREATE VIEW latest_enrichment AS {VIEW}")
    _grant()


def downgrade() -> None:
    op.execute("DROP VIEW latest_enrichment")
    for name, _ in reversed(COLUMNS):
        op.execute(f"ALTER TABLE product_enrichment DROP COLUMN {name}")
    op.execute(f"CREATE VIEW latest_enrichment AS {OLD_VIEW}")
    _grant()
