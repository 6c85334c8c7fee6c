"""The README's "With Redis and Postgres" commands and its producer example, run as written on a
fresh database (a scratch name, the tiny model, 4 products, this test's queue)."""

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import make_url, text

from tests import support
from tests.worker.conftest import REPO_ROOT
from weir.jobs.db import make_engine
from weir.worker.testing import TINY_CPU_KV_CACHE_BYTES

README = os.path.join(REPO_ROOT, "README.md")
CATALOG = os.path.join(REPO_ROOT, "..", "shared", "data", "bigbasket_products.csv")
NUM_PRODUCTS = 4


def readme_block(heading: str, language: str) -> str:
    """The first ```language block under the README's ``## heading``."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    section = readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def substitute(script: str, pattern: str, replacement: str) -> str:
    """Replace the one match of ``pattern``; fails when the README no longer has exactly one."""
    new, count = re.subn(pattern, lambda match: replacement, script)
    assert count == 1, f"README block no longer has one match of {pattern!r}:\n{script}"
    return new


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group the script started (its background worker too), then SIGKILL."""
    for sig, grace_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@pytest.mark.integration
def test_redis_and_postgres_section_runs_as_written_on_a_fresh_database(
        postgres_url, tiny_model_dir, redis_url, queue, tmp_path):
    # postgres_url: only for its skip (or CI failure) when no server answers; the block makes its own
    if not os.path.exists(CATALOG):
        pytest.skip(f"no catalog at {CATALOG} (the README's commands read it)")
    name = f"weir_readme_{secrets.token_hex(4)}"
    database_url = make_url(support.POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    script = readme_block("With Redis and Postgres", "bash")
    script = substitute(script, r"(?<=export WEIR_BROKER_URL=)\S+", redis_url)
    script = substitute(script, r"(?<=export WEIR_DATABASE_URL=)\S+", database_url)
    script = substitute(script, r"--limit \d+", f"--limit {NUM_PRODUCTS}")

    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),  # the `weir` script
        PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        WEIR_MODEL=tiny_model_dir, WEIR_DEVICE="cpu", WEIR_MAX_NUM_SEQS="4",
        WEIR_CPU_KV_CACHE_BYTES=str(TINY_CPU_KV_CACHE_BYTES), WEIR_QUEUE=queue, OMP_NUM_THREADS="1",
    )
    log_path = tmp_path / "readme.log"
    admin = make_engine(support.POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with open(log_path, "wb") as log:
            # its own process group: the block's `weir worker --beat &` outlives the script
            shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=REPO_ROOT, env=env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = shell.wait(timeout=150)
            assert returncode == 0, log_path.read_text(errors="replace")[-4000:]
            # the producer example, against the same worker (still running in the group)
            producer = subprocess.run(
                [sys.executable, "-c", readme_block("Producing jobs", "python")],
                env=dict(env, WEIR_BROKER_URL=redis_url, WEIR_DATABASE_URL=database_url),
                cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
        finally:
            stop_group(shell)
        assert producer.returncode == 0, producer.stderr[-4000:]
        lines = producer.stdout.splitlines()
        assert lines[0] == "completed 2/2 succeeded"
        assert [line.split()[:2] for line in lines[1:]] == [["tea", "succeeded"], ["soap", "succeeded"]]

        output = log_path.read_text(errors="replace")
        assert f"created database {name}" in output
        assert f"jobs:                {2 * NUM_PRODUCTS} succeeded, 0 failed" in output
        engine = make_engine(database_url)
        try:
            with engine.connect() as connection:
                batches = connection.execute(text(
                    "SELECT status, num_jobs, num_succeeded FROM batches ORDER BY created_at")).all()
                enriched = connection.execute(text(
                    "SELECT count(*) FROM product_enrichment WHERE category IS NOT NULL "
                    "AND description IS NOT NULL AND quality IS NOT NULL")).scalar_one()
        finally:
            engine.dispose()
        assert [tuple(row) for row in batches] == [("completed", 2 * NUM_PRODUCTS, 2 * NUM_PRODUCTS),
                                                   ("completed", 2, 2)]
        assert enriched == NUM_PRODUCTS
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.integration
def test_the_producer_example_runs_as_written_with_no_server_and_files_the_soap_right(tmp_path):
    # no WEIR_* variable: the packaged SmolLM2 on an in-process worker, results in ./weir.db
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", readme_block("Producing jobs", "python")], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, (
        "no WEIR_BROKER_URL: running the jobs on an in-process worker (loading model SmolLM2-135M-Instruct); "
        "results in sqlite:///weir.db\n")), done.stderr[-4000:]
    status, tea, soap = done.stdout.splitlines()
    assert (status, tea.split()[:3], soap) == (
        "completed 2/2 succeeded", ["tea", "succeeded", "Green"], "soap succeeded Beauty & Hygiene")
    assert (tmp_path / "weir.db").exists()
