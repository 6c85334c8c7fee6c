"""Application data in a job's request moves under ``extensions``: the catalog's mark,
``request.enrichment``, becomes ``request.extensions.enrichment`` (the queue core keeps each
application's data under its name, checked by the model the application registers).

A data migration: every stored request that has an ``enrichment`` key is rewritten in one
``UPDATE`` (on Postgres through ``jsonb``, the column staying ``json``; on SQLite with its JSON
functions); other requests are untouched. The downgrade moves it back.

Revision ID: 20261205_0009
Revises: 20261202_0008
Create Date: 2026-12-05
"""

from __future__ import annotations

from typing import Sequence, Union

from alembic import op

revision: str = "20261205_0009"
down_revision: Union[str, None] = "20261202_0008"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

UPGRADE = {
    "postgresql": (
        "UPDATE jobs SET request = ((request::jsonb - 'enrichment') || jsonb_build_object("
        "'extensions', jsonb_build_object('enrichment', request::jsonb -> 'enrichment')))::json "
        "WHERE jsonb_exists(request::jsonb, 'enrichment')"),
    "sqlite": (
        "UPDATE jobs SET request = json_set(json_remove(request, '$.enrichment'), '$.extensions', "
        "json_object('enrichment', json(json_extract(request, '$.enrichment')))) "
        "WHERE json_type(request, '$.enrichment') IS NOT NULL"),
}
DOWNGRADE = {  # the mark back to its old place, then every request without ``extensions``
    "postgresql": (
        "UPDATE jobs SET request = ((request::jsonb - 'extensions') || jsonb_build_object("
        "'enrichment', request::jsonb -> 'extensions' -> 'enrichment'))::json "
        "WHERE jsonb_exists(request::jsonb -> 'extensions', 'enrichment')",
        "UPDATE jobs SET request = (request::jsonb - 'extensions')::json "
        "WHERE jsonb_exists(request::jsonb, 'extensions')"),
    "sqlite": (
        "UPDATE jobs SET request = json_set(json_remove(request, '$.extensions'), '$.enrichment', "
        "json(json_extract(request, '$.extensions.enrichment'))) "
        "WHERE json_type(request, '$.extensions.enrichment') IS NOT NULL",
        "UPDATE jobs SET request = json_remove(request, '$.extensions') "
        "WHERE json_type(request, '$.extensions') IS NOT NULL"),
}


def upgrade() -> None:
    op.execute(UPGRADE[op.get_bind().dialect.name])


def downgrade() -> None:
    for statement in DOWNGRADE[op.get_bind().dialect.name]:
        op.execute(statement)
