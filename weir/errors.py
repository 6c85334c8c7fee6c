"""One line for each operational error the ``weir`` command line meets: a database or broker it
cannot reach, a setting that does not parse, a file it cannot read.

:func:`one_line` says what failed and where, in words a user of Postgres and Celery reads at a
glance; anything else (a bug) it leaves to the traceback.
"""

from __future__ import annotations

import os
import traceback
from typing import Optional

from kombu.utils.url import maybe_sanitize_url


def _squeeze(text: str) -> str:
    """One line: the text's lines joined by "; ", runs of white space made one space."""
    return "; ".join(" ".join(line.split()) for line in text.splitlines() if line.strip())


def _database_reason(exc: BaseException) -> str:
    """The driver's reason without its preamble: psycopg says ``connection failed: connection to
    server at "h", port p failed: FATAL:  database "x" does not exist``; the URL is named anyway."""
    reason = _squeeze(str(getattr(exc, "orig", None) or exc))
    reason = reason.rsplit(" failed: ", 1)[-1]
    return reason.removeprefix("FATAL: ").split(" (Background on this error", 1)[0]


def _is_missing_table(exc: BaseException) -> bool:
    """A statement on a table or column the schema does not have (Postgres' undefined_table 42P01
    or undefined_column 42703): an unmigrated or older database."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in ("42P01", "42703")


def _settings_error(exc: BaseException) -> Optional[str]:
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError) or not exc.title.endswith("Settings"):
        return None
    problems = []
    for error in exc.errors():
        name = "WEIR_" + "_".join(str(part) for part in error["loc"]).upper()
        problems.append(f"{name}: {error['msg'].removeprefix('Value error, ')}")
    return "invalid setting " + "; ".join(problems)


def _raised_in(exc: BaseException, package: str) -> bool:
    """Whether a frame of ``exc``'s traceback is in ``package`` (a top-level package's name)."""
    marker = f"{os.sep}{package}{os.sep}"
    return any(marker in frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc.__traceback__))


def one_line(exc: BaseException, *, database_url: Optional[str] = None,
             broker_url: Optional[str] = None) -> Optional[str]:
    """One line saying what failed, or None when ``exc`` is not an operational error.

    Args:
        exc: what the command raised.
        database_url: the results database's URL, named in a database error (password hidden).
        broker_url: the broker's URL, named in a broker error (password hidden).

    Returns:
        The line (no program name, no newline), or None: a bug, to be shown with its traceback.
    """
    from alembic.util.exc import CommandError
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError, ProgrammingError

    from weir.jobs.client import BrokerNotConfigured, BrokerUnreachable, PublishError

    where = f" at {maybe_sanitize_url(database_url)}" if database_url else ""
    if isinstance(exc, (OperationalError, InterfaceError)):
        reason = _database_reason(exc)
        if exc.statement:  # connected, then a statement failed (a timeout, a lost connection)
            return f"database error{where}: {reason}"
        hint = "; `weir db upgrade` creates it" if reason.startswith("database ") and "does not exist" in reason else ""
        return f"cannot connect to the database{where}: {reason}{hint}"
    if isinstance(exc, ProgrammingError) and _is_missing_table(exc):
        return (f"the database{where} has no weir tables (or an older schema): run `weir db upgrade` "
                f"({_database_reason(exc).split('; LINE ', 1)[0]})")
    if isinstance(exc, ArgumentError):
        named = f"={database_url!r}" if database_url else ""
        return f"WEIR_DATABASE_URL{named} is not a database URL SQLAlchemy can use ({_squeeze(str(exc))})"
    if isinstance(exc, ImportError) and database_url and _raised_in(exc, "sqlalchemy"):
        return (f"WEIR_DATABASE_URL={maybe_sanitize_url(database_url)!r} needs the driver module {exc.name!r}, "
                "which is not installed (weir installs psycopg for postgresql+psycopg:// and uses Python's "
                "sqlite3 for sqlite://)")
    if isinstance(exc, CommandError):  # alembic's: an unknown revision, a branch it cannot resolve
        return f"migrations: {_squeeze(str(exc))}"
    if isinstance(exc, (BrokerNotConfigured, BrokerUnreachable, PublishError)):
        return str(exc)
    if isinstance(exc, BrokerError):
        at = f" at {maybe_sanitize_url(broker_url)}" if broker_url else ""
        return f"cannot reach the broker{at}: {_squeeze(str(exc)) or type(exc).__name__}"
    if isinstance(exc, OSError):
        return _squeeze(str(exc)) or type(exc).__name__
    return _settings_error(exc)

