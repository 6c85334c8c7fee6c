"""The downstream contract: read views, their indexes, a batch channel and a read-only role.

What services downstream of weir may rely on (``docs/downstream.md`` is the contract):

- Views ``latest_enrichment`` (one row per catalog and product, with ``publishable`` = quality
  ``ok``), ``batch_summary`` (one row per batch, with its metadata's ``kind`` and ``catalog``)
  and ``failed_jobs`` (one row per failed job, with its error).
- Indexes for the documented queries the existing ones do not serve: ``batches.created_at``
  (recent batches), ``product_enrichment.updated_at`` (rows changed since a time) and
  ``product_enrichment.source_batch_id`` (the rows a batch wrote). Failed jobs of a batch use
  ``ix_jobs_batch_id_status``; lookups by product use ``product_enrichment``'s key.
- Postgres only: the ``weir_batch`` channel. Triggers on ``batches`` call ``pg_notify`` once per
  status change (insert, a status that differs from the old one, delete), in the transaction that
  made the change, so a notification is sent exactly when, and only if, the change commits. The
  payload is JSON: ``batch_id``, ``status`` (``deleted`` for a deleted row), ``num_jobs``,
  ``num_succeeded``, ``num_failed``, ``num_cancelled``. SQLite has no NOTIFY.
- Postgres only: the ``weir_reader`` role (NOLOGIN), ``SELECT`` on the views and the tables
  (``GRANT weir_reader TO someuser`` lets a login read). Roles belong to the server, not the
  database: the role is created only when missing (several databases of one server share it),
  and downgrade revokes what this database granted it but keeps the role and its members.

A later migration that alters a table these views read must drop the views first and create them
again after: SQLite's table copy (Alembic's batch mode) cannot rename a table a view names, and
Postgres refuses to drop or retype a column a view uses. Later tables are not granted to
``weir_reader`` unless their migration grants them.

Revision ID: 20261202_0007
Revises: 20261202_0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

from alembic import op

revision: str = "20261202_0007"
down_revision: Union[str, None] = "20261202_0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

READER_ROLE = "weir_reader"
CHANNEL = "weir_batch"
TABLES = ("batches", "jobs", "product_enrichment", "dead_letters")
VIEWS = ("latest_enrichment", "batch_summary", "failed_jobs")
INDEXES = (
    ("ix_batches_created_at", "batches", ["created_at"]),
    ("ix_product_enrichment_updated_at", "product_enrichment", ["updated_at"]),
    ("ix_product_enrichment_source_batch_id", "product_enrichment", ["source_batch_id"]),
)


def _views(dialect: str) -> dict[str, str]:
    if dialect == "postgresql":
        kind, catalog = "metadata ->> 'kind'", "metadata ->> 'catalog'"
    else:
        kind, catalog = "json_extract(metadata, '$.kind')", "json_extract(metadata, '$.catalog')"
    return {
        "latest_enrichment": (
            "SELECT catalog, product_id, category, category_confidence, description, quality, "
            "COALESCE(quality = 'ok', false) AS publishable, attributes, model, source_batch_id, "
            "source_batch_created_at, updated_at FROM product_enrichment"
        ),
        "batch_summary": (
            "SELECT id AS batch_id, status, model, "
            f"{kind} AS kind, {catalog} AS catalog, "
            "num_jobs, num_succeeded, num_failed, num_cancelled, created_at, started_at, finished_at "
            "FROM batches"
        ),
        "failed_jobs": (
            "SELECT batch_id, id AS job_id, batch_index, custom_id, kind, error, attempts, finished_at "
            "FROM jobs WHERE status = 'failed'"
        ),
    }


def _payload(row: str, status: str) -> str:
    return (f"json_build_object('batch_id', {row}.id, 'status', {status}, 'num_jobs', {row}.num_jobs, "
            f"'num_succeeded', {row}.num_succeeded, 'num_failed', {row}.num_failed, "
            f"'num_cancelled', {row}.num_cancelled)::text")


NOTIFY_FUNCTION = f"""
CREATE FUNCTION weir_notify_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('{CHANNEL}', {_payload("OLD", "'deleted'")});
    ELSE
        PERFORM pg_notify('{CHANNEL}', {_payload("NEW", "NEW.status")});
    END IF;
    RETURN NULL;
END
$$
"""

# A counter update also names ``status`` (it finishes the batch when the counts reach
# ``num_jobs``); only a value that differs is a change.
TRIGGERS = (
    "CREATE TRIGGER batches_notify_insert_delete AFTER INSERT OR DELETE ON batches "
    "FOR EACH ROW EXECUTE FUNCTION weir_notify_batch()",
    "CREATE TRIGGER batches_notify_status AFTER UPDATE OF status ON batches "
    "FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION weir_notify_batch()",
)

# Two databases of one server migrated at once both find the role missing: the second CREATE
# waits for the first to commit and then fails on the catalog's unique index.
CREATE_ROLE = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        BEGIN
            CREATE ROLE {READER_ROLE} NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'role {READER_ROLE} does not exist and % may not create roles', current_user
                    USING HINT = 'create it once per server as a superuser (CREATE ROLE {READER_ROLE} NOLOGIN), '
                                 'then run weir db upgrade again';
        END;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO {READER_ROLE}', current_schema());
END
$$
"""

REVOKE_SCHEMA = f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        EXECUTE 'REVOKE SELECT ON {", ".join(TABLES)} FROM {READER_ROLE}';
        EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM {READER_ROLE}', current_schema());
    END IF;
END
$$
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns)
    for name, select in _views(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {select}")
    if dialect != "postgresql":
        return
    op.execute(NOTIFY_FUNCTION)
    for trigger in TRIGGERS:
        op.execute(trigger)
    op.execute(CREATE_ROLE)
    op.execute(f"GRANT SELECT ON {', '.join(TABLES + VIEWS)} TO {READER_ROLE}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(REVOKE_SCHEMA)  # the views' grants go with the views
        op.execute("DROP TRIGGER batches_notify_status ON batches")
        op.execute("DROP TRIGGER batches_notify_insert_delete ON batches")
        op.execute("DROP FUNCTION weir_notify_batch()")
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    for name, table, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
