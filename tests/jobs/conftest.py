import pytest

from tests.jobs import support


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a fresh, migrated Postgres database for this test run."""
    with support.fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return support.tiny_chat_model_dir(tmp_path_factory)
