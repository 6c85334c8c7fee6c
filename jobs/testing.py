"""Test support for code that needs a real results database (as ``celery.contrib.testing`` is to Celery)."""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import make_url, text

from jobs.db import make_engine


@contextmanager
def temporary_postgres_database(admin_url: str, prefix: str = "weir_test_") -> Iterator[str]:
    """Create a fresh, empty Postgres database and drop it on exit.

    Args:
        admin_url: URL of a database the user may connect to with CREATEDB rights (``.../postgres``).
        prefix: name prefix; a random hex suffix makes each database unique.

    Yields:
        The URL of the new database (same server and credentials as ``admin_url``).

    Raises:
        sqlalchemy.exc.OperationalError: the server cannot be reached or refuses CREATE DATABASE.
    """
    name = prefix + secrets.token_hex(6)
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin.url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()
