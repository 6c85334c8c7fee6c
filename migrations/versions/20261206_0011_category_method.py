"""How each category was chosen: ``product_enrichment.category_method``, ``llm`` (a classification
job: the model scored the labels) or ``knn`` (the nearest-neighbour vote of labelled products, no
model; the job spec's ``[classify] method`` ``knn`` or ``hybrid``). ``category_confidence`` is the
label's probability for ``llm`` and its share of the vote for ``knn``. The view
``latest_enrichment`` shows it after ``category_confidence``.

Rows written before this revision hold null. The view is dropped and created again around the
column change (revision 0007 says why); on Postgres its grant to ``weir_reader`` goes with it and
is given again. The downgrade restores 0010's view.

Revision ID: 20261206_0011
Revises: 20261205_0010
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "20261206_0011"
down_revision: Union[str, None] = "20261205_0010"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

READER_ROLE = "weir_reader"

VIEW = (
    "SELECT catalog, product_id, category, category_confidence, category_method, category_decision, "
    "category_reasons, description, quality, description_decision, description_reasons, "
    "COALESCE(category_decision = 'auto', false) AND COALESCE(description_decision = 'auto', false) "
    "AND (COALESCE(attributes_decision = 'auto', false) OR (attributes_decision IS NULL "
    "AND NOT COALESCE(attributes_wanted, false))) AS publishable, "
    "attributes, attributes_decision, attributes_reasons, attributes_confidence, model, source_batch_id, source_batch_created_at, "
    "updated_at FROM product_enrichment"
)
# 0010's view, copied rather than imported: a revision stands alone, as it ran
OLD_VIEW = (
    "SELECT catalog, product_id, category, category_confidence, category_decision, category_reasons, "
    "description, quality, description_decision, description_reasons, "
    "COALESCE(category_decision = 'auto', false) AND COALESCE(description_decision = 'auto', false) "
    "AND (COALESCE(attributes_decision = 'auto', false) OR (attributes_decision IS NULL "
    "AND NOT COALESCE(attributes_wanted, false))) AS publishable, "
    "attributes, attributes_decision, attributes_reasons, attributes_confidence, model, source_batch_id, source_batch_created_at, "
    "updated_at FROM product_enrichment"
)


def _grant() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN "
                   f"GRANT SELECT ON latest_enrichment TO {READER_ROLE}; END IF; END $$")


def upgrade() -> None:
    op.execute("DROP VIEW latest_enrichment")
    op.add_column("product_enrichment", sa.Column("category_method", sa.String(16), nullable=True))
    op.execute(f"CREATE VIEW latest_enrichment AS {VIEW}")
    _grant()


def downgrade() -> None:
    op.execute("DROP VIEW latest_enrichment")
    op.execute("ALTER TABLE product_enrichment DROP COLUMN category_method")
    op.execute(f"CREATE VIEW latest_enrichment AS {OLD_VIEW}")
    _grant()
