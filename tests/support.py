"""Shared pieces of the jobs/ and worker/ tests: service URLs, a fresh database, a tiny chat model."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

import pytest

from weir.worker.testing import service_urls

# Test-only knobs (the project's own settings come from weir.config).
REDIS_URL, POSTGRES_ADMIN_URL = service_urls()

_tiny_model_dir: Optional[str] = None


def _missing_service(message: str) -> None:
    """Skip on a developer machine without the service; in CI (``CI`` set) a missing service is
    a failure, so a green run always means the integration tests ran."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new ``weir_test_<random>`` database migrated to head, dropped afterwards; skips the
    test when no Postgres server answers at ``WEIR_TEST_POSTGRES_URL``."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from weir import migrations
    from weir.jobs.db import make_engine
    from weir.jobs.testing import temporary_postgres_database

    probe = make_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    try:
        with probe.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        _missing_service(f"no Postgres at {POSTGRES_ADMIN_URL}: {exc.orig}")
    finally:
        probe.dispose()
    with temporary_postgres_database(POSTGRES_ADMIN_URL) as url:
        migrations.upgrade(url)
        yield url


def redis_or_skip() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as exc:
        _missing_service(f"no Redis at {REDIS_URL}: {exc}")
    return REDIS_URL


def tiny_chat_model_dir(tmp_path_factory) -> str:
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and chat template
    (:func:`weir.jobs.testing.save_tiny_chat_model`), saved once per test process."""
    global _tiny_model_dir
    if _tiny_model_dir is None:
        from weir.jobs.testing import save_tiny_chat_model

        _tiny_model_dir = save_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat-llama")))
    return _tiny_model_dir
