"""Alembic environment: runs migrations online against the URL given in the config's attributes."""

from __future__ import annotations

from alembic import context

from weir.jobs.applications import load_tables
from weir.jobs.db import Base, make_engine

config = context.config
load_tables()  # the applications' tables join the core's on one metadata
target_metadata = Base.metadata


def run_migrations_online() -> None:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: call migrations.upgrade(url) or set sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things; batch mode copies the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("weir runs migrations online only")
run_migrations_online()
