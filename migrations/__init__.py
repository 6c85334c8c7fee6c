"""Alembic migrations of weir's results database, run through Alembic's Python API.

``weir db upgrade`` calls :func:`upgrade`; no ``alembic.ini`` is needed: the script location is
this package's folder, and the database URL is handed to ``env.py`` in the config's attributes.
Revision files live in ``versions/``, named ``YYYYMMDD_NNNN_slug.py``, each with a ``downgrade``.
"""

from __future__ import annotations

import os

from alembic import command
from alembic.config import Config

SCRIPT_LOCATION = os.path.dirname(os.path.abspath(__file__))


def alembic_config(url: str) -> Config:
    """An Alembic ``Config`` for this package's scripts, targeting the database at ``url``."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest).

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached.
    """
    command.upgrade(alembic_config(url), revision)


def create_database_if_missing(url: str, maintenance_database: str = "postgres") -> bool:
    """Create the Postgres database ``url`` names when the server has none of that name, as
    ``createdb`` does: from a connection to ``maintenance_database`` on the same server, with the
    same credentials. A SQLite file is created by its first connection, so nothing is done there.

    Returns:
        True when the database was created, False when it existed (or is not Postgres).

    Raises:
        sqlalchemy.exc.OperationalError: the server cannot be reached, or refuses CREATE DATABASE
            (the user lacks CREATEDB: create it with ``createdb`` as a user who has it).
    """
    from sqlalchemy import make_url, text

    from weir.jobs.db import make_engine

    target = make_url(url)
    if not target.drivername.startswith("postgres") or not target.database:
        return False
    admin = make_engine(target.set(database=maintenance_database).render_as_string(hide_password=False),
                        isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            exists = connection.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": target.database}).first()
            if exists:
                return False
            quoted = connection.dialect.identifier_preparer.quote(target.database)
            connection.execute(text(f"CREATE DATABASE {quoted}"))
            return True
    finally:
        admin.dispose()


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"``: drop every table)."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    """The newest revision in ``versions/``."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at; None when it has never been migrated."""
    from alembic.runtime.migration import MigrationContext

    from weir.jobs.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
