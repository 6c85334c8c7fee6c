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
