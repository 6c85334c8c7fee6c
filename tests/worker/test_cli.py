"""The ``weir`` command line, run as a subprocess like a user would."""

import csv
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest
from sqlalchemy import make_url

from tests import support
from tests.worker.conftest import REPO_ROOT
from weir import migrations


def weir(*args, env_overrides=None, cwd=REPO_ROOT, timeout_s=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_overrides or {})
    return subprocess.run([sys.executable, "-m", "weir", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def test_worker_without_broker_exits_with_a_clear_message():
    done = weir("worker")
    assert done.returncode == 2
    assert "WEIR_BROKER_URL is not set" in done.stderr


def test_commands_that_need_a_broker_say_so_in_one_line_without_one(tmp_path):
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    said = {command: weir(*command.split(), env_overrides=env) for command in ("worker", "sweep", "health worker")}
    assert {command: (done.returncode, done.stdout, done.stderr) for command, done in said.items()} == {
        "worker": (2, "", "weir worker: WEIR_BROKER_URL is not set (e.g. redis://127.0.0.1:6379/0). A worker serves "
                          "a shared broker; to run a catalog without one, use `weir enrich`, which starts an "
                          "in-process worker.\n"),
        "sweep": (2, "", "weir sweep: WEIR_BROKER_URL is not set (e.g. redis://127.0.0.1:6379/0); without a broker "
                         "no message waits to be swept: weir enrich and the client run their jobs in-process\n"),
        "health worker": (2, "", "weir health worker: WEIR_BROKER_URL is not set\n"),
    }


def test_worker_refuses_an_unmigrated_database(redis_url):
    # A SQLite file would be migrated on the spot; a shared Postgres database is only checked.
    with support.fresh_postgres_database() as url:
        migrations.downgrade(url, "base")
        done = weir("worker", env_overrides={"WEIR_BROKER_URL": redis_url, "WEIR_DATABASE_URL": url})
    assert done.returncode == 2
    assert "database is at revision None" in done.stderr and "run `weir db upgrade`" in done.stderr


def test_commands_on_an_unmigrated_database_say_to_upgrade_in_one_line(redis_url):
    with support.fresh_postgres_database() as url:
        migrations.downgrade(url, "base")
        env = {"WEIR_BROKER_URL": redis_url, "WEIR_DATABASE_URL": url}
        for command in (["sweep"], ["results", "00000000-0000-0000-0000-000000000000"], ["db", "reconcile"]):
            done = weir(*command, env_overrides=env)
            name = " ".join(command[:2] if command[0] == "db" else command[:1])
            assert_one_line_error(done, contains=f"weir {name}: the database at ")
            assert "has no weir tables (or an older schema): run `weir db upgrade`" in done.stderr


def test_db_upgrade_and_downgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'weir.db'}"
    up = weir("db", "upgrade", env_overrides={"WEIR_DATABASE_URL": url})
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == f"database at revision {migrations.head_revision()}"
    down = weir("db", "downgrade", "base", env_overrides={"WEIR_DATABASE_URL": url})
    assert (down.returncode, down.stdout.strip()) == (0, "database at revision None")


def test_db_reconcile_repairs_counters_changed_by_hand(tmp_path):
    from sqlalchemy import update

    from weir.jobs.batches import cancel_job
    from weir.jobs.db import Batch, BatchStatus, make_engine, make_session_factory
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    session_factory = make_session_factory(engine)
    with session_factory.begin() as session:
        batch, [job] = support.create_batch(session, [GenerateRequest(prompt="p")], model="tiny")
    with session_factory.begin() as session:
        cancel_job(session, job.id)
        session.execute(update(Batch).where(Batch.id == batch.id).values(
            num_cancelled=0, status=BatchStatus.IN_PROGRESS, finished_at=None))
    engine.dispose()
    done = weir("db", "reconcile", env_overrides={"WEIR_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"batch {batch.id}: (succeeded, failed, cancelled, status) (0, 0, 0, 'in_progress') -> (0, 0, 1, 'completed')",
        "1 batches repaired"]
    again = weir("db", "reconcile", env_overrides={"WEIR_DATABASE_URL": url})
    assert again.stdout.splitlines() == ["0 batches repaired"]


def test_results_prints_every_field_of_each_job_as_json_lines(tmp_path):
    import json

    from weir.jobs.db import JobStatus, make_engine, make_session_factory
    from weir.jobs.results import JobResult
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    session_factory = make_session_factory(engine)
    request = GenerateRequest(prompt="p", custom_id="one", n=2, stop="}", response_format={"type": "json_object"})
    with session_factory.begin() as session:
        batch, [job] = support.create_batch(session, [request], model="tiny")
    completions = [{"index": i, "text": "{}", "finish_reason": "stop", "stop_reason": "}", "num_tokens": 2,
                    "cumulative_logprob": None, "logprobs": None, "parsed": {}} for i in range(2)]
    with session_factory.begin() as session:
        job = support.claim_job(session, job.id)
    with session_factory.begin() as session:
        support.record_result(session, job, JobResult(status=JobStatus.SUCCEEDED, output_text="{}", finish_reason="stop",
                                                    completions=completions, parsed={}, num_completion_tokens=4))
    engine.dispose()
    env = {"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    done = weir("results", str(batch.id), env_overrides=env)
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    assert (row["custom_id"], row["status"], row["completions"], row["parsed"], row["num_completion_tokens"]) == (
        "one", "succeeded", completions, {}, 4)
    assert (row["sampling_params"]["n"], row["sampling_params"]["stop"], row["sampling_params"]["response_format"]) == (
        2, ["}"], {"type": "json_object"})
    missing = weir("results", "00000000-0000-0000-0000-000000000000", env_overrides=env)
    assert (missing.returncode, missing.stderr) == (
        2, "weir results: no batch with id 00000000-0000-0000-0000-000000000000\n")


def test_results_show_the_catalogs_decision_on_an_enrichment_job(tmp_path):
    from weir.jobs.db import JobStatus, make_engine, make_session_factory
    from weir.jobs.results import JobResult
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    session_factory = make_session_factory(engine)
    mark = {"catalog": "/c.csv", "product_id": "1",
            "listing": {"name": "Cotton Duvet Cover", "brand": "Spaces", "description": "", "category": "Home"}}
    requests = [GenerateRequest(prompt="p", custom_id="1/description", extensions={"enrichment": mark}),
                GenerateRequest(prompt="p", custom_id="plain")]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny")
    for job, text in zip(jobs, ["A Spaces duvet cover made with 100% wool.", "Anything."]):
        with session_factory.begin() as session:
            claimed = support.claim_job(session, job.id)
        with session_factory.begin() as session:
            support.record_result(session, claimed, JobResult(status=JobStatus.SUCCEEDED, output_text=text,
                                                              finish_reason="stop"))
    engine.dispose()
    done = weir("results", str(batch.id), env_overrides={"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/m"})
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["annotations"] for row in rows] == [
        {"enrichment": {"field": "description", "decision": "review", "reasons": [
            {"code": "unsupported_number", "text": "100%"}, {"code": "unsupported_material", "text": "wool"}]}},
        {}]


def test_batches_lists_the_most_recent_batches_with_status_and_counts(tmp_path):
    import datetime

    from sqlalchemy import update

    from weir.jobs.batches import cancel_batch
    from weir.jobs.db import Batch, JobStatus, make_engine, make_session_factory
    from weir.jobs.results import JobResult
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    env = {"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    migrations.upgrade(url)
    assert (weir("batches", env_overrides=env).stdout) == f"no batches in {url}\n"
    engine = make_engine(url)
    session_factory = make_session_factory(engine)
    with session_factory.begin() as session:
        done, [job, _] = support.create_batch(session, [GenerateRequest(prompt="p"), GenerateRequest(prompt="q")],
                                              model="tiny")
        cancelled, _ = support.create_batch(session, [GenerateRequest(prompt="p")] * 3, model="SmolLM2-135M-Instruct")
        for batch, minute in ((done, 1), (cancelled, 2)):
            session.execute(update(Batch).where(Batch.id == batch.id)
                            .values(created_at=datetime.datetime(2026, 5, 1, 12, minute, 30)))
    with session_factory.begin() as session:
        job = support.claim_job(session, job.id)
    with session_factory.begin() as session:
        support.record_result(session, job, JobResult(status=JobStatus.SUCCEEDED, output_text="x", finish_reason="stop"))
        cancel_batch(session, cancelled.id)
    engine.dispose()
    listed = weir("batches", env_overrides=env)
    assert (listed.returncode, listed.stderr) == (0, "")
    assert listed.stdout.splitlines() == [
        "batch                                 status       jobs  succeeded  failed  cancelled  created (UTC)        model",
        f"{cancelled.id}  cancelled       3          0       0          3  2026-05-01 12:02:30  SmolLM2-135M-Instruct",
        f"{done.id}  in_progress     2          1       0          0  2026-05-01 12:01:30  tiny"]
    assert weir("batches", "--limit", "1", env_overrides=env).stdout.splitlines()[1:] == [
        f"{cancelled.id}  cancelled     3          0       0          3  2026-05-01 12:02:30  SmolLM2-135M-Instruct"]
    refused = weir("batches", "--limit", "0", env_overrides=env)
    assert (refused.returncode, refused.stderr) == (2, "weir batches: --limit must be >= 1, got 0\n")


def test_a_database_driver_not_installed_and_an_unknown_revision_are_one_line(tmp_path):
    missing = weir("batches", env_overrides={"WEIR_DATABASE_URL": "mysql://x@y/z"})
    assert (missing.returncode, missing.stdout, missing.stderr) == (2, "", (
        "weir batches: WEIR_DATABASE_URL='mysql://x@y/z' needs the driver module 'MySQLdb', which is not "
        "installed (weir installs psycopg for postgresql+psycopg:// and uses Python's sqlite3 for sqlite://)\n"))
    unknown = weir("db", "downgrade", "no-such-revision", env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert (unknown.returncode, unknown.stdout, unknown.stderr) == (
        2, "", "weir db downgrade: migrations: Can't locate revision identified by 'no-such-revision'\n")


@pytest.mark.integration
def test_enrich_with_a_kv_cache_too_small_for_one_sequence_is_one_line_and_enqueues_nothing(tiny_model_dir, tmp_path):
    catalog = tmp_path / "catalog.csv"
    _write_catalog(catalog, 2)
    done = weir("enrich", str(catalog), cwd=str(tmp_path), timeout_s=300, env_overrides={
        "WEIR_MODEL": tiny_model_dir, "WEIR_DEVICE": "cpu", "WEIR_CPU_KV_CACHE_BYTES": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.fullmatch(r"weir enrich: the engine cannot start: max_model_len=\d+ needs \d+ KV blocks of 16 tokens "
                        r"but only \d+ fit; lower max_model_len or give the cache more memory; nothing was enqueued",
                        done.stderr.splitlines()[-1]), done.stderr
    with sqlite3.connect(tmp_path / "weir.db") as db:
        assert db.execute("SELECT count(*) FROM batches").fetchone()[0] == 0


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """``weir batches | head``: the closed pipe is status 141 (128 + SIGPIPE), as a shell reports
    it, with nothing on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""), WEIR_SQLITE_PATH=str(tmp_path / "w.db"))
    migrations.upgrade(f"sqlite:///{tmp_path / 'w.db'}")
    proc = subprocess.Popen([sys.executable, "-m", "weir", "batches"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes its first line
    stderr = proc.stderr.read()
    assert (proc.wait(timeout=120), stderr) == (141, b"")


def test_an_unknown_worker_log_level_is_refused_before_anything_starts():
    done = weir("worker", "--loglevel", "NOPE", env_overrides={"WEIR_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "weir worker: error: argument --loglevel: 'NOPE' is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")


def test_an_id_that_is_not_a_uuid_is_one_line_naming_it(tmp_path):
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    said = {}
    for command in (["results", "nope"], ["batch", "status", "nope"], ["batch", "results", "nope", "--output",
                                                                        str(tmp_path / "o.jsonl")],
                    ["cancel", "nope"], ["cancel", "--job", "nope"]):
        done = weir(*command, env_overrides=env)
        said[" ".join(command[:3 if command[0] == "cancel" else 2])] = (done.returncode, done.stdout, done.stderr)
    assert said == {
        "results nope": (2, "", "weir results: 'nope' is not a batch id (a UUID)\n"),
        "batch status": (2, "", "weir batch status: 'nope' is not a batch id (a UUID)\n"),
        "batch results": (2, "", "weir batch results: 'nope' is not a batch id (a UUID)\n"),
        "cancel nope": (2, "", "weir cancel: 'nope' is not a batch id (a UUID)\n"),
        "cancel --job nope": (2, "", "weir cancel: 'nope' is not a job id (a UUID)\n")}
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_results_as_csv_into_a_file_that_appears_only_once_complete(tmp_path):
    from weir.jobs.db import JobStatus, make_engine, make_session_factory
    from weir.jobs.results import JobResult, record_results
    from weir.jobs.schemas import ClassifyRequest, GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    session_factory = make_session_factory(engine)
    requests = [GenerateRequest(prompt="p", custom_id="one", metadata={"sku": "é1"}),
                ClassifyRequest(prompt="p", labels=["Tea", "Soap"], custom_id="two")]
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model="tiny")
    with session_factory.begin() as session:
        jobs = [support.claim_job(session, job.id) for job in jobs]
    with session_factory.begin() as session:
        record_results(session, [
            (jobs[0], JobResult(status=JobStatus.SUCCEEDED, output_text='Tea, "green"\nfresh.', finish_reason="stop",
                                num_prompt_tokens=3, num_completion_tokens=5, num_cached_tokens=0)),
            (jobs[1], JobResult.failure("boom")),
        ])
    engine.dispose()
    env = {"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    out = tmp_path / "results.csv"
    done = weir("results", str(batch.id), "--format", "csv", "--output", str(out), env_overrides=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert out.read_bytes().decode("utf-8") == (
        "job_id,custom_id,kind,status,attempts,output_text,finish_reason,label,label_probs,parsed,"
        "num_prompt_tokens,num_completion_tokens,num_cached_tokens,error,metadata\r\n"
        f'{jobs[0].id},one,generate,succeeded,1,"Tea, ""green""\nfresh.",stop,,,,3,5,0,,"{{""sku"":""é1""}}"\r\n'
        f"{jobs[1].id},two,classify,failed,1,,,,,,,,,boom,{{}}\r\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    probe = tmp_path / "probe"
    probe.write_text("")  # the file has the mode any new file gets, not a temporary file's 0600
    assert out.stat().st_mode == probe.stat().st_mode
    nowhere = tmp_path / "missing" / "results.csv"
    refused = weir("results", str(batch.id), "--format", "csv", "--output", str(nowhere), env_overrides=env)
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2, "", f"weir results: cannot write {nowhere}: No such file or directory\n")


def test_results_refuses_an_existing_output_file_unless_forced(tmp_path):
    from weir.jobs.db import make_engine, make_session_factory
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    with make_session_factory(engine).begin() as session:
        batch, _ = support.create_batch(session, [GenerateRequest(prompt="p", custom_id="one")], model="tiny")
    engine.dispose()
    env = {"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    out = tmp_path / "results.csv"
    out.write_text("keep me")
    refused = weir("results", str(batch.id), "--format", "csv", "--output", str(out), env_overrides=env)
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2, "", f"weir results: {out} already exists; --force replaces it\n")
    assert out.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "weir.db"]
    forced = weir("results", str(batch.id), "--format", "csv", "--output", str(out), "--force", env_overrides=env)
    assert (forced.returncode, forced.stderr) == (0, "")
    assert out.read_text().splitlines()[1].split(",")[1:4] == ["one", "generate", "queued"]


def test_enrich_missing_column(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product\n1,Tea\n")
    done = weir("enrich", str(path), env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert done.returncode == 2
    assert done.stderr == (
        f"weir enrich: {path}: no column 'category'; header is ['index', 'product']; name the columns with "
        "--category-col or in a job spec (--spec FILE, layout in jobs/catalog/spec.py)\n")


def test_enrich_wrong_columns_name_the_flags_and_the_shipped_spec_the_header_fits(tmp_path):
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    other = tmp_path / "other.csv"
    other.write_text("sku,title,category\n1,Tea,Drinks\n")
    done = weir("enrich", str(other), env_overrides=env)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        f"weir enrich: {other}: no column 'index', 'product'; header is ['sku', 'title', 'category']; name the "
        "columns with --id-col, --product-col or in a job spec (--spec FILE, layout in jobs/catalog/spec.py)\n"))
    flipkart = tmp_path / "flipkart.csv"  # the header of ../shared/data/flipkart_products.csv, shortened
    flipkart.write_text("uniq_id,product_name,product_category_tree,description,brand\n"
                        '1,Tea,"[""Drinks >> Tea""]",Green.,Leafy\n')
    done = weir("enrich", str(flipkart), env_overrides=env)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        f"weir enrich: {flipkart}: no column 'index', 'product', 'category'; header is ['uniq_id', 'product_name', "
        "'product_category_tree', 'description', 'brand']; the header fits the shipped spec flipkart (--spec "
        "flipkart); or name the columns with --id-col, --product-col, --category-col or in a job spec (--spec "
        "FILE, layout in jobs/catalog/spec.py)\n"))


def test_enrich_refuses_a_catalog_that_is_not_utf_8_unless_its_encoding_is_given(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(b"index,product,brand,description,category\n,Caf\xe9,B,D,Drinks\n")
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    done = weir("enrich", str(path), env_overrides=env)
    assert (done.returncode, done.stderr) == (2, (
        f"weir enrich: {path}: line 2, byte offset 45: 0xe9 is not valid utf-8; convert the file to UTF-8 "
        "(iconv -f LATIN1 -t UTF-8 in.csv > out.csv) or give its encoding (weir enrich --encoding latin-1)\n"))
    done = weir("enrich", str(path), "--encoding", "latin-1", env_overrides=env)
    assert (done.returncode, done.stderr.splitlines()) == (2, [  # read: its one row has no id
        "weir enrich: skipped 1 rows: 1 with no id ('index' empty)", f"weir enrich: {path} has no products"])


def test_enrich_refuses_a_codec_that_is_not_a_text_encoding_in_one_line(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product,brand,description,category\n1,Tea,B,D,Drinks\n")
    done = weir("enrich", str(path), "--encoding", "rot13", env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "weir enrich: encoding 'rot13' is not a text encoding (a Python text codec name: utf-8, latin-1, "
        "cp1252, ...)\n"))


def test_enrich_says_a_catalog_is_empty_or_has_only_a_header(tmp_path):
    path = tmp_path / "c.csv"
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    path.write_text("")
    empty = weir("enrich", str(path), env_overrides=env)
    assert (empty.returncode, empty.stderr) == (2, f"weir enrich: {path}: the file is empty\n")
    path.write_text("index,product,brand,description,category\n")
    header_only = weir("enrich", str(path), env_overrides=env)
    assert (header_only.returncode, header_only.stderr) == (
        2, f"weir enrich: {path}: the file has no rows, only a header\n")


def test_enrich_names_the_optional_columns_a_catalog_lacks(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product,category\n,Tea,Drinks\n")
    done = weir("enrich", str(path), env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert done.returncode == 2  # its one row has no id
    assert done.stderr.splitlines() == [
        f"weir enrich: {path}: no column 'brand', 'description' (optional): prompts leave out the brand and "
        "description",
        "weir enrich: skipped 1 rows: 1 with no id ('index' empty)",
        f"weir enrich: {path} has no products"]


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_enrich_refuses_a_limit_below_one(tmp_path, limit):
    done = weir("enrich", "missing.csv", "--limit", limit,
                env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert done.returncode == 2
    assert done.stderr.strip() == f"weir enrich: --limit must be >= 1, got {limit}"


@pytest.mark.integration
def test_enrich_embedded_runs_the_tasks_in_process(tiny_model_dir, tmp_path):
    catalog = tmp_path / "catalog.csv"
    with open(catalog, "w", newline="", encoding="utf-8") as f:
        rows = csv.writer(f, lineterminator="\r\n")
        rows.writerow(["index", "product", "category", "brand", "description"])
        rows.writerow(["1", "Green Tea", "Beverages", "Leafy ", "A tea.\nTwo lines."])
        rows.writerow(["2", "Soap Bar", "Beauty & Hygiene", "Clean", ""])
        rows.writerow(["3", "Rice", "Foodgrains, Oil & Masala", "Grain", "Long grain."])
    # the default spec, categories by the hybrid method and an [extract] schema: a third job per
    # product. Product 2's neighbours all say Beverages (share 1: the vote decides, no job); product
    # 1's are split (share 0.53: the model classifies it)
    spec = tmp_path / "shop.toml"
    spec.write_text('[classify]\nmethod = "hybrid"\nvote_threshold = 0.9\n'
                    '[extract.fields]\nunit = { enum = ["g", "kg"] }\n[extract.sampling]\nmax_tokens = 24\n')
    started_s = time.monotonic()
    done = weir(
        "enrich", str(catalog), "--limit", "2", "--spec", str(spec),
        cwd=str(tmp_path),
        env_overrides={"WEIR_MODEL": tiny_model_dir, "WEIR_DEVICE": "cpu", "WEIR_MAX_NUM_SEQS": "4",
                       "WEIR_CPU_KV_CACHE_BYTES": str(8 << 20)},
        timeout_s=300,
    )
    real_s = time.monotonic() - started_s
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[:2] == [
        "weir enrich: no WEIR_BROKER_URL, running an in-process worker; results in sqlite:///weir.db",
        f"weir enrich: loading model {os.path.basename(tiny_model_dir)} ({tiny_model_dir})"]
    # the whole command: starting Python, loading the model, the batch, the summary; so more than
    # the batch, no more than the test saw, and most of it (Python's start before the clock is not)
    found = re.search(r"^wall time: +([0-9.]+) s \(the batch ([0-9.]+) s\)$", done.stdout, re.M)
    wall_s, batch_s = float(found.group(1)), float(found.group(2))
    assert batch_s < wall_s <= real_s and wall_s >= real_s / 2
    assert "jobs:                5 succeeded, 0 failed" in done.stdout
    assert "category accuracy:" in done.stdout and "over 2 products" in done.stdout
    with sqlite3.connect(tmp_path / "weir.db") as db:
        rows = db.execute(
            "SELECT product_id, category IS NOT NULL, description IS NOT NULL, quality IS NOT NULL "
            "FROM product_enrichment "
            "ORDER BY product_id").fetchall()
        methods = db.execute("SELECT product_id, category_method, category_confidence FROM product_enrichment "
                             "ORDER BY product_id").fetchall()
        classified = db.execute("SELECT custom_id FROM jobs WHERE kind = 'classify'").fetchall()
        attributes = db.execute(
            "SELECT e.attributes, j.finish_reason, j.parsed FROM product_enrichment e JOIN jobs j "
            "ON j.custom_id = e.product_id || '/attributes' ORDER BY e.product_id").fetchall()
        batch = db.execute("SELECT status, num_jobs, num_succeeded FROM batches").fetchall()
    assert rows == [("1", 1, 1, 1), ("2", 1, 1, 1)]
    assert (methods[0][:2], methods[1]) == (("1", "llm"), ("2", "knn", 1.0)) and classified == [("1/category",)]
    assert "descriptions clean:" in done.stdout
    assert batch == [("completed", 5, 5)]
    # a finished extraction is the schema's object, the same value as its job's parsed output
    for stored, finish_reason, parsed in attributes:
        if finish_reason == "stop":
            assert json.loads(stored) == json.loads(parsed) and json.loads(stored)["unit"] in ("g", "kg", None)
        else:
            assert (finish_reason, stored) == ("length", None)
    num_valid = sum(reason == "stop" for _, reason, _ in attributes)
    assert f"attributes:          {num_valid} of 2 extracted valid ({2 - num_valid} cut by max_tokens)" in done.stdout
    assert "products:            2 enriched of 2 (2 new, 0 changed, 0 unfinished, 0 unchanged skipped, 0 failed)" in done.stdout
    # incremental: nothing changed, nothing is enqueued (and no model is loaded)
    again = weir("enrich", str(catalog), "--limit", "2", "--spec", str(spec), cwd=str(tmp_path),
                 env_overrides={"WEIR_MODEL": tiny_model_dir}, timeout_s=120)
    assert (again.returncode, again.stdout) == (0, "weir enrich: nothing to enrich: all 2 products are unchanged "
                                                   "since their last enrichment (same content, job spec and model); "
                                                   "--full redoes them\n")


def _write_catalog(path, num_products):
    with open(path, "w", newline="", encoding="utf-8") as f:
        rows = csv.writer(f)
        rows.writerow(["index", "product", "category", "brand", "description"])
        for i in range(1, num_products + 1):
            rows.writerow([str(i), f"Product {i}", ["Beverages", "Snacks"][i % 2], "Brand", ""])


@pytest.mark.integration
def _start_embedded_enrich(model_dir, cwd, *args) -> subprocess.Popen:
    """``weir enrich ARGS`` with no broker on the tiny model, in ``cwd``, in a process group of its
    own, so that a SIGINT to the group reaches every process of the run, as Ctrl-C in a terminal does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""), WEIR_MODEL=model_dir,
               WEIR_DEVICE="cpu", WEIR_MAX_NUM_SEQS="2", WEIR_CPU_KV_CACHE_BYTES=str(8 << 20))
    return subprocess.Popen([sys.executable, "-m", "weir", "enrich", *args], cwd=str(cwd), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_in_the_embedded_run_cancels_the_unfinished_jobs_and_says_how_to_resume(tiny_model_dir, tmp_path, stop):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) or SIGTERM to the command
    alone (as ``timeout``, ``kill``, Docker and systemd send it)."""
    import signal
    import time

    catalog = tmp_path / "catalog.csv"
    num_products = 200  # far more than the run gets through before the interrupt
    _write_catalog(catalog, num_products)
    spec = tmp_path / "slow.toml"  # descriptions of 64 tokens each, no stop string
    spec.write_text("[describe.sampling]\nmax_tokens = 64\nstop = []\n")
    database = tmp_path / "weir.db"
    proc = _start_embedded_enrich(tiny_model_dir, tmp_path, str(catalog), "--spec", str(spec))
    try:
        deadline = time.monotonic() + 240
        num_succeeded = 0
        while num_succeeded < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if database.exists():
                with sqlite3.connect(database, timeout=10) as db:
                    try:
                        num_succeeded = db.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()[0]
                    except sqlite3.OperationalError:  # not migrated yet
                        pass
        assert proc.poll() is None and num_succeeded >= 4, "the run ended, or ran no job, before the interrupt"
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr[-3000:]
    with sqlite3.connect(database) as db:
        (batch_id, status, num_jobs, succeeded, failed, cancelled), = db.execute(
            "SELECT id, status, num_jobs, num_succeeded, num_failed, num_cancelled FROM batches").fetchall()
        jobs = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        num_enriched = db.execute("SELECT count(*) FROM product_enrichment WHERE category IS NOT NULL "
                                  "AND description IS NOT NULL").fetchone()[0]
    # nothing is left queued or running: nothing would ever run it
    assert (status, num_jobs, failed) == ("cancelled", 2 * num_products, 0)
    assert jobs == {"succeeded": succeeded, "cancelled": cancelled} and succeeded + cancelled == num_jobs
    assert 0 < succeeded < num_jobs and num_enriched < num_products
    batch = str(uuid.UUID(batch_id))
    assert "Traceback" not in stderr and stdout == ""
    assert stderr.splitlines()[-2:] == [
        f"weir enrich: interrupted; cancelling batch {batch}'s unfinished jobs and stopping the in-process worker",
        f"weir enrich: batch {batch} cancelled: {succeeded} of {num_jobs} jobs succeeded, {cancelled} cancelled; "
        f"{num_products - num_enriched} products are left: the same command without --full enriches only those"]


def test_ctrl_c_while_the_embedded_run_loads_its_model_says_nothing_was_enqueued(tiny_model_dir, tmp_path):
    import signal

    catalog = tmp_path / "catalog.csv"
    _write_catalog(catalog, 20)
    proc = _start_embedded_enrich(tiny_model_dir, tmp_path, str(catalog))
    try:
        lines = []
        while proc.poll() is None and not (lines and lines[-1].startswith("weir enrich: loading model")):
            lines.append(proc.stderr.readline().rstrip("\n"))
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: every process of the run
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and stdout == ""
    assert stderr.splitlines()[-1:] == ["weir enrich: interrupted before its batch was stored; nothing was enqueued"]
    database = tmp_path / "weir.db"
    if database.exists():
        with sqlite3.connect(database) as db:
            try:
                assert db.execute("SELECT count(*) FROM batches").fetchone()[0] == 0
            except sqlite3.OperationalError:  # not migrated yet
                pass


def test_sweep_and_cancel_commands(redis_url, postgres_url):
    env = {"WEIR_BROKER_URL": redis_url, "WEIR_DATABASE_URL": postgres_url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    done = weir("sweep", "--older-than-s", "60", env_overrides=env)
    assert (done.returncode, done.stdout) == (0, "published 0 jobs again\n")
    done = weir("cancel", "00000000-0000-0000-0000-000000000000", env_overrides=env)
    assert (done.returncode, done.stderr) == (2, "weir cancel: no batch with id 00000000-0000-0000-0000-000000000000\n")
    assert weir("sweep", env_overrides={"WEIR_DATABASE_URL": postgres_url}).returncode == 2


def assert_one_line_error(done, returncode=2, *, contains):
    """Exit status ``returncode``, and stderr one line (no traceback) naming what failed."""
    assert done.returncode == returncode, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert contains in done.stderr


@pytest.mark.parametrize("broker_url, contains", [
    ("redis://127.0.0.1:1/0", "cannot reach the broker at redis://127.0.0.1:1/0"),
    ("redis//x", "invalid setting WEIR_BROKER_URL: 'redis//x' is not a broker URL"),
])
def test_worker_with_a_bad_broker_url_is_one_line(postgres_url, broker_url, contains):
    env = {"WEIR_BROKER_URL": broker_url, "WEIR_DATABASE_URL": postgres_url}
    assert_one_line_error(weir("worker", env_overrides=env), contains=f"weir worker: {contains}")


def test_strict_priority_without_the_priority_policy_is_one_line_before_anything_starts(tmp_path):
    # the default policy is priority (with strict priority): only an explicit fcfs conflicts
    env = {"WEIR_STRICT_PRIORITY": "true", "WEIR_BROKER_URL": "redis://127.0.0.1:1/0",
           "WEIR_SCHEDULING_POLICY": "fcfs"}
    done = weir("worker", env_overrides=env, cwd=str(tmp_path))
    assert done.returncode == 2
    assert done.stderr == ("weir worker: invalid setting WEIR_STRICT_PRIORITY: true needs "
                           "WEIR_SCHEDULING_POLICY=priority\n")


def test_worker_on_a_busy_metrics_port_is_one_line_before_the_model_loads(redis_url, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that does not exist: had the engine been loaded first, it would be the error
        env = {"WEIR_BROKER_URL": redis_url, "WEIR_METRICS_PORT": str(port), "WEIR_MODEL": str(tmp_path / "none.gguf"),
               "WEIR_DATABASE_URL": f"sqlite:///{tmp_path / 'weir.db'}"}
        done = weir("worker", env_overrides=env, cwd=str(tmp_path))
    assert done.returncode == 2
    assert done.stderr == f"weir worker: WEIR_METRICS_PORT={port}: cannot listen on 0.0.0.0:{port}: Address already in use\n"
    assert not (tmp_path / "weir.db").exists()  # refused before the database was touched


@pytest.mark.parametrize("setting, value, message", [
    ("WEIR_CPU_OMP_THREADS_BIND", "4096", "WEIR_CPU_OMP_THREADS_BIND='4096' names CPUs this process may not use: 4096"),
    ("WEIR_CPU_NUM_OF_RESERVED_CPU", "4096", "WEIR_CPU_NUM_OF_RESERVED_CPU=4096 leaves the engine core no CPU"),
])
def test_cpus_this_host_lacks_are_one_line_before_the_model_loads(redis_url, tmp_path, setting, value, message):
    env = {"WEIR_BROKER_URL": redis_url, setting: value, "WEIR_MODEL": str(tmp_path / "none.gguf"),
           "WEIR_DATABASE_URL": f"sqlite:///{tmp_path / 'weir.db'}"}
    done = weir("worker", env_overrides=env, cwd=str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith(f"weir worker: {message}") and done.stderr.count("\n") == 1
    assert not (tmp_path / "weir.db").exists()  # refused before the database was touched


def test_sweep_and_enrich_with_a_bad_broker_url_are_one_line(postgres_url, tmp_path):
    env = {"WEIR_BROKER_URL": "redis://127.0.0.1:1/0", "WEIR_DATABASE_URL": postgres_url}
    assert_one_line_error(weir("sweep", env_overrides=env),
                          contains="weir sweep: cannot reach the broker at redis://127.0.0.1:1/0")
    done = weir("enrich", "missing.csv", env_overrides=dict(env, WEIR_BROKER_URL="redis//x"))
    assert_one_line_error(done, contains="invalid setting WEIR_BROKER_URL")


def test_a_missing_database_is_one_line(redis_url):
    url = make_url(support.POSTGRES_ADMIN_URL).set(database="weir_no_such_database").render_as_string()
    done = weir("worker", env_overrides={"WEIR_BROKER_URL": redis_url, "WEIR_DATABASE_URL": url})
    assert_one_line_error(done, contains='database "weir_no_such_database" does not exist; `weir db upgrade` creates it')
    assert_one_line_error(weir("db", "reconcile", env_overrides={"WEIR_DATABASE_URL": url}),
                          contains="weir db reconcile: cannot connect to the database at ")
    refused = "postgresql+psycopg://postgres@127.0.0.1:1/weir"
    assert_one_line_error(weir("db", "upgrade", env_overrides={"WEIR_DATABASE_URL": refused}),
                          contains=f"weir db upgrade: cannot connect to the database at {refused}: Connection refused")


def test_traceback_flag_shows_the_traceback():
    done = weir("--traceback", "db", "upgrade",
                env_overrides={"WEIR_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/weir"})
    assert done.returncode == 1 and "Traceback" in done.stderr


def test_db_upgrade_creates_a_missing_postgres_database():
    from sqlalchemy import text

    from weir.jobs.db import make_engine
    from weir.jobs.testing import temporary_postgres_database

    with temporary_postgres_database(support.POSTGRES_ADMIN_URL) as scratch:
        admin = make_engine(support.POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        name = make_url(scratch).database
        with admin.connect() as connection:  # the name is ours, the database gone
            connection.execute(text(f'DROP DATABASE "{name}"'))
        admin.dispose()
        first = weir("db", "upgrade", env_overrides={"WEIR_DATABASE_URL": scratch})
        again = weir("db", "upgrade", env_overrides={"WEIR_DATABASE_URL": scratch})
    head = migrations.head_revision()
    assert (first.returncode, first.stdout) == (0, f"created database {name}\ndatabase at revision {head}\n")
    assert (again.returncode, again.stdout) == (0, f"database at revision {head}\n")


def test_enrich_missing_catalog_file_and_bad_spec_are_one_line(tmp_path):
    env = {"WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    assert_one_line_error(weir("enrich", str(tmp_path / "missing.csv"), env_overrides=env),
                          contains="No such file or directory")
    catalog = tmp_path / "c.csv"
    catalog.write_text("index,product,brand,description,category\n1,Tea,B,D,Beverages\n")
    spec = tmp_path / "spec.toml"
    spec.write_text("[columns\nname = 1\n")
    assert_one_line_error(weir("enrich", str(catalog), "--spec", str(spec), env_overrides=env),
                          contains=f"weir enrich: {spec}")


def test_enrich_with_an_unknown_spec_name_lists_the_shipped_specs(tmp_path):
    done = weir("enrich", "c.csv", "--spec", "nosuch", env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert (done.returncode, done.stderr) == (2, "weir enrich: no shipped spec 'nosuch' (shipped: bigbasket, "
                                                 "flipkart); or give the path of a TOML spec file (layout in "
                                                 "jobs/catalog/spec.py)\n")


def test_enrich_says_which_rows_it_skipped(tmp_path):
    catalog = tmp_path / "c.csv"
    catalog.write_text("index,product,brand,description,category\n"
                       ",Tea,B,D,Beverages\n2,,B,D,Beverages\n3,  ,B,D,Beverages\n")
    done = weir("enrich", str(catalog), env_overrides={"WEIR_SQLITE_PATH": str(tmp_path / "w.db")})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "weir enrich: skipped 3 rows: 1 with no id ('index' empty), 2 with no name ('product' empty)",
        f"weir enrich: {catalog} has no products"]


def test_every_command_and_option_has_help():
    import argparse

    from weir.cli import build_parser

    def undocumented(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if not choice.help:
                        yield f"{path} {choice.dest}"
                for name, sub in action.choices.items():
                    if name != "bench":  # its own parsers (bench.run, bench.cls) document it
                        yield from undocumented(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}"

    assert list(undocumented(build_parser(), "weir")) == []


@pytest.mark.integration
def test_ctrl_c_stops_a_worker_with_status_130_and_no_traceback(worker_env, tmp_path):
    import signal

    from weir.worker.testing import WorkerProcess

    worker = WorkerProcess(worker_env, str(tmp_path / "worker.log"), cwd=REPO_ROOT)
    try:
        worker.wait_ready()
        worker.proc.send_signal(signal.SIGINT)
        assert worker.proc.wait(60) == 130
    finally:
        worker.kill()
    assert "Warm shutdown" in worker.log() and "Traceback" not in worker.log()


def _chat_line(custom_id, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "Hi"}], **body}}) + "\n"


def test_batch_submit_refuses_a_bad_file_naming_each_line_and_stores_nothing(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(_chat_line("a", temperature=-1) + _chat_line("b") + _chat_line("c", logit_bias={}))
    db = tmp_path / "w.db"
    done = weir("batch", "submit", str(requests), env_overrides={"WEIR_SQLITE_PATH": str(db)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"weir batch submit: {requests}: line 1: body.temperature: must be a finite number >= 0, got -1",
        f"weir batch submit: {requests}: line 3: body.logit_bias: not supported for /v1/chat/completions",
        f"weir batch submit: {requests}: 2 bad lines; nothing was stored"]
    assert sqlite3.connect(db).execute("SELECT count(*) FROM batches").fetchone() == (0,)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    nothing = weir("batch", "submit", str(blank), env_overrides={"WEIR_SQLITE_PATH": str(db)})
    assert (nothing.returncode, nothing.stdout, nothing.stderr) == (
        2, "", f"weir batch submit: {blank}: the file holds no request (it is empty or blank); nothing was stored\n")
    bad_option = weir("batch", "submit", str(requests), "--completion-window", "1d",
                      env_overrides={"WEIR_SQLITE_PATH": str(db)})
    assert (bad_option.returncode, bad_option.stderr) == (
        2, "weir batch submit: completion window '1d' is not a duration like 24h, 90m or 3600s\n")
    zero = weir("batch", "submit", str(requests), "--completion-window", "0s",
                env_overrides={"WEIR_SQLITE_PATH": str(db)})
    assert (zero.returncode, zero.stderr) == (
        2, "weir batch submit: completion window '0s' must be positive (24h, 90m, 3600s)\n")


def test_batch_submit_reports_a_too_long_prompt_with_the_other_bad_lines(tiny_model_dir, tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(_chat_line("a", temperature=-1) + _chat_line("b") + _chat_line("c", max_tokens=600)
                        + json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
                                      "body": {"messages": [{"role": "user", "content": "word " * 600}]}}) + "\n")
    db = tmp_path / "w.db"
    done = weir("batch", "submit", str(requests), env_overrides={"WEIR_SQLITE_PATH": str(db), "WEIR_MODEL": tiny_model_dir})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"weir batch submit: {requests}: line 1: body.temperature: must be a finite number >= 0, got -1",
        f"weir batch submit: {requests}: line 3: body.max_tokens: max_tokens=600 is more than max_model_len=512",
        f"weir batch submit: {requests}: line 4: body.messages: prompt has 631 tokens; max_model_len=512 leaves no "
        "room for output",
        f"weir batch submit: {requests}: 3 bad lines; nothing was stored"]
    assert sqlite3.connect(db).execute("SELECT count(*) FROM batches").fetchone() == (0,)


def test_batch_results_refuses_existing_output_or_error_files_unless_forced(tmp_path):
    from weir.jobs import openai_batch
    from weir.jobs.batches import cancel_batch
    from weir.jobs.db import make_engine, make_session_factory
    from weir.jobs.schemas import GenerateRequest

    url = f"sqlite:///{tmp_path / 'weir.db'}"
    migrations.upgrade(url)
    requests = tmp_path / "in.jsonl"
    requests.write_text(_chat_line("a"))
    engine = make_engine(url)
    with make_session_factory(engine).begin() as session:
        meta = openai_batch.batch_metadata(openai_batch.CHAT_COMPLETIONS, str(requests), "24h")
        batch, [job] = support.create_batch(session, [GenerateRequest(prompt="p", custom_id="a")], model="tiny",
                                            metadata=meta)
        cancel_batch(session, batch.id)
    engine.dispose()
    env = {"WEIR_DATABASE_URL": url, "WEIR_MODEL": "/nonexistent/no-such-model"}
    batch_id = str(batch.id)
    errors = tmp_path / "in.errors.jsonl"

    own = weir("batch", "results", batch_id, "--output", str(requests), env_overrides=env)
    assert (own.returncode, own.stdout, own.stderr) == (
        2, "", f"weir batch results: {requests} already exists; --force replaces it\n")
    assert requests.read_text() == _chat_line("a")
    errors.write_text("old errors")
    both = weir("batch", "results", batch_id, "--output", str(requests), env_overrides=env)
    assert (both.returncode, both.stderr) == (
        2, f"weir batch results: {requests} and {errors} already exist; --force replaces them\n")
    output = tmp_path / "out.jsonl"
    only_errors = weir("batch", "results", batch_id, "--output", str(output), "--errors", str(errors),
                       env_overrides=env)
    assert (only_errors.returncode, only_errors.stderr) == (
        2, f"weir batch results: {errors} already exists; --force replaces it\n")
    default_errors = tmp_path / "out.errors.jsonl"
    default_errors.write_text("old default errors")
    by_default = weir("batch", "results", batch_id, "--output", str(output), env_overrides=env)
    assert (by_default.returncode, by_default.stderr) == (
        2, f"weir batch results: {default_errors} already exists; --force replaces it\n")
    assert (errors.read_text(), default_errors.read_text()) == ("old errors", "old default errors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.errors.jsonl", "in.jsonl", "out.errors.jsonl", "weir.db"]

    forced = weir("batch", "results", batch_id, "--output", str(output), "--force", env_overrides=env)
    assert (forced.returncode, forced.stderr) == (0, f"0 responses in {output}, 1 errors in {default_errors}\n")
    assert output.read_text() == ""
    assert [json.loads(line)["custom_id"] for line in default_errors.read_text().splitlines()] == ["a"]


def test_batch_expires_from_the_command_line_and_its_error_lines_stay_out_of_the_output_file(
        redis_url, queue, tiny_model_dir, tmp_path):
    import time
    import uuid
    from datetime import timezone

    from weir.jobs.batches import get_batch, list_jobs
    from weir.jobs.db import JobStatus, make_engine, make_session_factory
    from weir.jobs.results import JobResult

    openai = pytest.importorskip("openai")
    env = {"WEIR_BROKER_URL": redis_url, "WEIR_QUEUE": queue, "WEIR_MODEL": tiny_model_dir,
           "WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    requests = tmp_path / "in.jsonl"
    requests.write_text(_chat_line("a") + _chat_line("b") + _chat_line("c"))
    submitted = weir("batch", "submit", str(requests), "--completion-window", "2s", env_overrides=env)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    # no worker consumes the queue: one job succeeds and one fails as a worker would record them
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    session_factory = make_session_factory(engine)
    with session_factory() as session:
        a, b, c = list_jobs(session, uuid.UUID(batch_id))
    for job, result in [(a, JobResult(status=JobStatus.SUCCEEDED, output_text="Hi", finish_reason="stop",
                                      num_prompt_tokens=3, num_completion_tokens=1)),
                        (b, JobResult(status=JobStatus.FAILED, error="engine: boom"))]:
        with session_factory.begin() as session:
            assert support.record_result(session, support.claim_job(session, job.id), result)
    with session_factory() as session:  # naive UTC on SQLite
        created_at = get_batch(session, uuid.UUID(batch_id)).created_at.replace(tzinfo=timezone.utc)
    time.sleep(max(0.0, created_at.timestamp() + 2 - time.time()) + 0.5)

    status = weir("batch", "status", batch_id, env_overrides=env)
    assert status.returncode == 0, status.stderr
    expired = openai.types.Batch.model_validate_json(status.stdout)
    assert (expired.status, expired.completion_window, expired.request_counts.total,
            expired.request_counts.completed, expired.request_counts.failed) == ("expired", "2s", 3, 1, 1)
    assert expired.expires_at <= expired.expired_at <= time.time()
    with session_factory() as session:
        assert [j.status for j in list_jobs(session, uuid.UUID(batch_id))] == [
            JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED]
    engine.dispose()

    output = tmp_path / "out.jsonl"
    results = weir("batch", "results", batch_id, "--output", str(output), env_overrides=env)
    errors = tmp_path / "out.errors.jsonl"  # no --errors: beside the output file, as OpenAI keeps them apart
    assert (results.returncode, results.stderr) == (0, f"1 responses in {output}, 2 errors in {errors}\n")
    from openai.types.chat import ChatCompletion

    [response] = map(json.loads, output.read_text().splitlines())
    assert (response["custom_id"], response["response"]["status_code"], response["error"]) == ("a", 200, None)
    assert ChatCompletion.model_validate(response["response"]["body"]).choices[0].message.content == "Hi"
    assert [(line["custom_id"], line["response"], line["error"])
            for line in map(json.loads, errors.read_text().splitlines())] == [
        ("b", None, {"code": "job_failed", "message": "engine: boom"}),
        ("c", None, {"code": "batch_expired",
                     "message": "the batch's completion window passed before this request ran"})]
    same = weir("batch", "results", batch_id, "--output", str(output), "--errors", str(output), env_overrides=env)
    assert (same.returncode, same.stderr) == (
        2, f"weir batch results: --errors {output} is the output file; OpenAI keeps them apart\n")


def test_batch_submit_status_cancel_and_results(redis_url, queue, tiny_model_dir, tmp_path):
    openai = pytest.importorskip("openai")
    worker_env = {"WEIR_BROKER_URL": redis_url, "WEIR_QUEUE": queue, "WEIR_MODEL": tiny_model_dir,
                  "WEIR_SQLITE_PATH": str(tmp_path / "w.db")}
    requests = tmp_path / "in.jsonl"
    requests.write_text(_chat_line("a", max_tokens=4) + "\n" + _chat_line("b", max_completion_tokens=4))
    submitted = weir("batch", "submit", str(requests), "--metadata", "team=search", env_overrides=worker_env)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()

    status = weir("batch", "status", batch_id, env_overrides=worker_env)
    assert status.returncode == 0, status.stderr
    batch = openai.types.Batch.model_validate_json(status.stdout)
    assert (batch.id, batch.status, batch.input_file_id, batch.endpoint, batch.metadata, batch.request_counts.total) \
        == (batch_id, "in_progress", str(requests), "/v1/chat/completions", {"team": "search"}, 2)

    cancelled = openai.types.Batch.model_validate_json(
        weir("batch", "cancel", batch_id, env_overrides=worker_env).stdout)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None

    output, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    results = weir("batch", "results", batch_id, "--output", str(output), "--errors", str(errors),
                   env_overrides=worker_env)
    assert (results.returncode, results.stderr) == (0, f"0 responses in {output}, 2 errors in {errors}\n")
    assert output.read_text() == ""
    assert [(line["custom_id"], line["response"], line["error"]["code"])
            for line in map(json.loads, errors.read_text().splitlines())] == [
        ("a", None, "batch_cancelled"), ("b", None, "batch_cancelled")]
