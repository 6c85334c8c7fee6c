"""The ``weir`` command line: ``worker``, ``batches``, ``results``, ``sweep``, ``cancel``, ``db``,
``health``, ``bench``, and the applications' commands (:data:`weir.jobs.applications.COMMANDS`: ``enrich``, ``batch``).

Settings come from ``WEIR_*`` environment variables (:mod:`weir.config`); flags cover only what
differs per run. Exit status: 0 on success, 1 when the work failed, 2 on a usage or setup error
(a database or broker that cannot be reached, a setting that does not parse: one line on stderr,
the traceback only with ``--traceback`` or ``--loglevel DEBUG``), 130 after Ctrl-C (SIGINT), 141
when the reader of its output went away (``weir batches | head``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from weir.config import Settings, get_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command stopped by Ctrl-C."""
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: the reader of the output went away (``weir batches | head``); nothing is printed."""

BROKER_CHECK_TIMEOUT_S = 5.0


def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def ensure_schema(settings: Settings) -> Optional[str]:
    """Migrate a SQLite database to head; for any other database only check it.

    Returns:
        None when the schema is current, else a message saying what to run.
    """
    from weir import migrations

    url = settings.database.url()
    if _is_sqlite(url):
        migrations.upgrade(url)
        return None
    current, head = migrations.current_revision(url), migrations.head_revision()
    if current != head:
        return f"database is at revision {current}, code expects {head}: run `weir db upgrade`"
    return None


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a Celery worker (threads pool) on the model's queue until a shutdown signal."""
    settings = get_settings()
    if not settings.worker.broker_url:
        print(
            "weir worker: WEIR_BROKER_URL is not set (e.g. redis://127.0.0.1:6379/0). A worker "
            "serves a shared broker; to run a catalog without one, use `weir enrich`, which starts "
            "an in-process worker.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from weir import health

    # Celery would retry a wrong or unreachable broker forever, after loading the model
    broker = health.check_broker(settings.worker.broker_url, timeout_s=BROKER_CHECK_TIMEOUT_S)
    if not broker.healthy:
        print(f"weir worker: {broker.message}", file=sys.stderr)
        return EXIT_USAGE
    if settings.worker.metrics_port:  # the engine would load first, then fail on a busy port
        from weir.worker.metrics import MetricsPortUnavailable, check_port

        try:
            check_port(settings.worker.metrics_port)
        except MetricsPortUnavailable as exc:
            print(f"weir worker: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if settings.worker.engine_multiprocessing:  # CPUs this host lacks: one line before the model loads
        from weir.worker.placement import plan

        try:
            plan(settings.worker.cpu_omp_threads_bind, settings.worker.cpu_num_of_reserved_cpu)
        except ValueError as exc:
            print(f"weir worker: {exc}", file=sys.stderr)
            return EXIT_USAGE
    problem = ensure_schema(settings)
    if problem:
        print(f"weir worker: {problem}", file=sys.stderr)
        return EXIT_USAGE

    from celery import signals

    import weir.worker.tasks  # noqa: F401  (registers the tasks)
    from weir.worker.app import app, make_worker

    shutdown_signals: list[str] = []
    signals.worker_shutting_down.connect(
        lambda sender=None, sig=None, **kwargs: shutdown_signals.append(sig), weak=False)
    controller = make_worker(
        app, settings, hostname=f"weir-{os.getpid()}@{os.uname().nodename}", loglevel=args.loglevel
    )
    from weir.engine.core import freeze_gc_heap

    # the engine has started (worker_init): this process's start-up objects (Celery, torch, the
    # tokenizer) live as long as it does; not done for the embedded worker, in a caller's process
    freeze_gc_heap()
    beat = None
    if args.beat:
        # Beat in a thread of this process, not Celery's forked child: a worker killed with
        # SIGKILL takes its beat along instead of leaving an orphan that schedules on forever.
        # Its own remote-control node, celerybeat@<host>, answers `weir health beat` while it ticks.
        from celery.beat import EmbeddedService

        beat = EmbeddedService(app, thread=True, remote_control=True)
        beat.start()
    try:
        controller.start()
    finally:
        if beat is not None:
            beat.stop()
    if "SIGINT" in shutdown_signals:  # Celery's own exit code for it is 1, as for a failure
        return EXIT_INTERRUPTED
    return controller.exitcode or EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    """Publish again the jobs whose message may be lost; print how many."""
    from weir.jobs.client import Client, PublishError

    settings = get_settings()
    if not settings.worker.broker_url:
        print("weir sweep: WEIR_BROKER_URL is not set (e.g. redis://127.0.0.1:6379/0); without a broker no "
              "message waits to be swept: weir enrich and the client run their jobs in-process", file=sys.stderr)
        return EXIT_USAGE
    client = Client(settings)
    try:
        num_published = client.sweep(args.older_than_s)
    except PublishError as exc:
        print(f"weir sweep: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        client.close()
    print(f"published {num_published} jobs again")
    return EXIT_OK


BATCH_COLUMNS = ("batch", "status", "jobs", "succeeded", "failed", "cancelled", "created (UTC)", "model")


def cmd_batches(args: argparse.Namespace) -> int:
    """Print the most recent batches, newest first: id, status, counts, creation time, model."""
    from weir.jobs.client import Client

    if args.limit < 1:
        print(f"weir batches: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return EXIT_USAGE
    settings = get_settings()
    client = Client(settings)
    try:
        batches = client.recent_batches(args.limit)
    finally:
        client.close()
    if not batches:
        print(f"no batches in {settings.database.url()}")
        return EXIT_OK
    rows = [BATCH_COLUMNS] + [
        (str(b.id), b.status.value, str(b.num_jobs), str(b.num_succeeded), str(b.num_failed), str(b.num_cancelled),
         b.created_at.strftime("%Y-%m-%d %H:%M:%S"), b.model) for b in batches]
    widths = [max(len(row[i]) for row in rows) for i in range(len(BATCH_COLUMNS))]
    numeric = {2, 3, 4, 5}
    for row in rows:
        cells = [cell.rjust(width) if i in numeric else cell.ljust(width)
                 for i, (cell, width) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())
    return EXIT_OK


def parse_id(text: str, what: str = "batch") -> Any:
    """``text`` as a UUID, the id of a batch (or, ``what="job"``, a job).

    Raises:
        ValueError: ``'nope' is not a batch id (a UUID)``.
    """
    import uuid

    try:
        return uuid.UUID(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a {what} id (a UUID)") from None


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a batch (or, with ``--job``, one job): queued jobs are skipped, running ones aborted."""
    from weir.jobs.client import Client

    try:
        target_id = parse_id(args.id, "job" if args.job else "batch")
    except ValueError as exc:
        print(f"weir cancel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    client = Client(get_settings())
    try:
        if args.job:
            job = client.cancel_job(target_id)
            print(f"job {job.id}: {job.status.value}")
        else:
            batch = client.cancel(target_id)
            print(f"batch {batch.id}: {batch.status.value}, {batch.num_cancelled} jobs cancelled")
    except (LookupError, ValueError) as exc:
        print(f"weir cancel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        client.close()
    return EXIT_OK


def existing_outputs(paths: Sequence[str]) -> Optional[str]:
    """One line naming those of ``paths`` that exist, or None (a folder is left to
    :func:`weir.jobs.export.atomic_output`, which says so)."""
    existing = [path for path in paths if os.path.lexists(path) and not os.path.isdir(path)]
    if not existing:
        return None
    if len(existing) == 1:
        return f"{existing[0]} already exists; --force replaces it"
    return f"{' and '.join(existing)} already exist; --force replaces them"


def cmd_results(args: argparse.Namespace) -> int:
    """Write a batch's results in submission order, streamed: JSON Lines (every key of
    :meth:`weir.jobs.client.Client.results`) or CSV (:data:`weir.jobs.export.CSV_COLUMNS`), to
    stdout or to ``--output`` (which appears only once complete, and replaces an existing file
    only with ``--force``)."""
    from weir.jobs import export
    from weir.jobs.client import Client

    write = export.WRITERS[args.format]
    try:
        batch_id = parse_id(args.batch_id)
    except ValueError as exc:
        print(f"weir results: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problem = None if args.output is None or args.force else existing_outputs([args.output])
    if problem:
        print(f"weir results: {problem}", file=sys.stderr)
        return EXIT_USAGE
    client = Client(get_settings())
    try:
        client.batch_status(batch_id)
        if args.output is None:
            try:
                write(client.results(batch_id), sys.stdout)
                sys.stdout.flush()
            except BrokenPipeError:  # `weir results B | head`: the reader has what it wanted
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return EXIT_OK
        else:
            with export.atomic_output(args.output, overwrite=args.force) as out:
                write(client.results(batch_id), out)
    except (LookupError, ValueError) as exc:
        print(f"weir results: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        if args.output is None:
            raise
        print(f"weir results: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        client.close()
    return EXIT_OK


def cmd_db(args: argparse.Namespace) -> int:
    """Run Alembic migrations on ``WEIR_DATABASE_URL`` (or the local SQLite file), or recount
    unfinished batches (``reconcile``)."""
    from weir import migrations

    url = get_settings().database.url()
    if args.db_command == "upgrade" and migrations.create_database_if_missing(url):
        from sqlalchemy import make_url

        print(f"created database {make_url(url).database}")
    if args.db_command == "reconcile":
        from weir.jobs import counters
        from weir.jobs.db import engine_for, make_session_factory

        engine = engine_for(get_settings().database)
        try:
            with make_session_factory(engine).begin() as session:
                repaired = counters.reconcile_batches(session)
        finally:
            engine.dispose()
        for fix in repaired:
            print(f"batch {fix.batch_id}: (succeeded, failed, cancelled, status) {fix.before} -> {fix.after}")
        print(f"{len(repaired)} batches repaired")
        return EXIT_OK
    if args.db_command == "upgrade":
        migrations.upgrade(url, args.revision)
    else:
        migrations.downgrade(url, args.revision)
    print(f"database at revision {migrations.current_revision(url)}")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when a worker of this host consumes this deployment's queue (``WEIR_QUEUE``, else
    ``weir.<model name>``), or this host's beat answers a ping; 1 with one line on stderr when not;
    2 without ``WEIR_BROKER_URL`` (:mod:`weir.health`)."""
    from weir import health

    settings = get_settings()
    broker_url = settings.worker.broker_url
    if not broker_url:
        print(f"weir health {args.process}: WEIR_BROKER_URL is not set", file=sys.stderr)
        return EXIT_USAGE
    if args.process == "worker":
        from weir.jobs import names

        queue = names.queue_for_model(settings.engine.model, settings.worker.queue)
        found = health.check_worker(broker_url, queue, hostname=args.hostname, timeout_s=args.timeout_s)
    else:
        found = health.check_beat(broker_url, hostname=args.hostname, timeout_s=args.timeout_s)
    print(f"weir health {args.process}: {found.message}", file=sys.stdout if found.healthy else sys.stderr)
    return found.exit_status


def cmd_bench(argv: Sequence[str]) -> int:
    """``weir bench cls ...`` hands the rest to ``bench.cls:main`` (W-cls); anything else goes to
    ``bench.run:main`` (W-gen)."""
    argv = list(argv)
    if argv and argv[0] == "cls":
        from bench.cls import main as cls_main

        return cls_main(argv[1:]) or EXIT_OK
    from bench.run import main as bench_main

    return bench_main(argv) or EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="weir: batch LLM inference on Celery, Redis "
                                     "and Postgres (a worker, producers' commands, migrations)",
                                     epilog="Settings: WEIR_* environment variables (README, Settings).")
    traceback_help = "on an operational error, show the traceback instead of one line"
    parser.add_argument("--traceback", action="store_true", help=traceback_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, **kwargs)
        # also after the command's name; SUPPRESS keeps the top-level flag when it is not repeated
        sub.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
        return sub

    worker = command("worker", "run a Celery worker (threads pool) on the model's queue (needs WEIR_BROKER_URL)")
    worker.add_argument("--loglevel", default="INFO", type=_log_level,
                        help="Celery's log level: DEBUG, INFO, WARNING, ERROR (default INFO; DEBUG also "
                             "shows tracebacks)")
    worker.add_argument("--beat", action="store_true",
                        help="also run Celery beat in this process: the sweeper and the nightly enrichment "
                             "(on one host only; `weir health beat` pings it)")
    worker.set_defaults(func=cmd_worker)

    from weir.jobs import applications

    # the applications' commands, each a function that adds its subcommands through command()
    # (reverse name order: enrich, the main job, before batch)
    for add_commands in reversed(applications.load_each(applications.COMMANDS).values()):
        add_commands(command)

    sweep = command("sweep", "publish again the jobs whose queue message may be lost (once; beat runs it "
                             "every WEIR_SWEEP_INTERVAL_S)")
    sweep.add_argument("--older-than-s", type=float, default=None,
                       help="jobs with no message for this many seconds (default WEIR_SWEEP_AFTER_S)")
    sweep.set_defaults(func=cmd_sweep)

    cancel = command("cancel", "cancel a batch, or one job with --job")
    cancel.add_argument("id", help="batch id (job id with --job)")
    cancel.add_argument("--job", action="store_true", help="the id is a job's")
    cancel.set_defaults(func=cmd_cancel)

    results = command("results", "write a batch's results, one job per line (JSON Lines or CSV)")
    results.add_argument("batch_id", help="the batch's id (printed by weir enrich, returned by enqueue_batch)")
    results.add_argument("--format", choices=["jsonl", "csv"], default="jsonl",
                         help="jsonl: every field (default); csv: the columns of docs/downstream.md")
    results.add_argument("--output", metavar="FILE", default=None,
                         help="write to FILE (appears only once complete) instead of stdout; an existing "
                              "FILE is refused unless --force")
    results.add_argument("--force", action="store_true", help="replace an existing --output FILE")
    results.set_defaults(func=cmd_results)

    batches = command("batches", "list the most recent batches, newest first: status, job counts, creation "
                                 "time, model")
    batches.add_argument("--limit", type=int, default=20, help="how many batches (default 20)")
    batches.set_defaults(func=cmd_batches)

    db = command("db", "migrate the results database (WEIR_DATABASE_URL), or repair batch counters")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_commands.add_parser(
        "upgrade", help="create a missing Postgres database, then migrate up (default: to the newest revision)")
    upgrade.add_argument("revision", nargs="?", default="head", help="Alembic revision (default head)")
    downgrade = db_commands.add_parser("downgrade", help="migrate down to REVISION ('base': drop all)")
    downgrade.add_argument("revision", help="Alembic revision, or 'base' to drop every table")
    db_commands.add_parser("reconcile", help="recount unfinished batches from their jobs and repair their counters")
    db.set_defaults(func=cmd_db)

    health = command("health", "exit 0 when a worker of this host consumes the queue (WEIR_QUEUE, else the "
                               "model's), or this host's beat answers a ping")
    health.add_argument("process", choices=["worker", "beat"], help="which process to ping")
    health.add_argument("--hostname", default=None,
                        help="exact node name (default: weir-*@<host> for a worker, celerybeat@<host>)")
    health.add_argument("--timeout-s", type=float, default=5.0, help="wait this many seconds for the answer")
    health.set_defaults(func=cmd_health)

    commands.add_parser("bench", help="benchmarks: W-gen (bench.run), `bench cls` W-cls (bench.cls); "
                                      "`weir bench --help` lists their options", add_help=False)
    return parser


def _process_started_s() -> float:
    """When this process started, on the ``time.monotonic()`` clock: the interpreter's start and
    weir's imports count in a command's wall time (psutil's ``create_time``, 10 ms resolution)."""
    import psutil

    return time.monotonic() - max(0.0, time.time() - psutil.Process().create_time())


def _settings_or_none() -> Optional[Settings]:
    try:
        return get_settings()
    except Exception:  # the command itself reports a setting that does not parse
        return None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "FATAL")


def _log_level(value: str) -> str:
    """A Celery log level name, any case (argparse reports a ValueError as an invalid value)."""
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level ({', '.join(LOG_LEVELS[:5])})")
    return value.upper()


def _wants_traceback(args: argparse.Namespace) -> bool:
    return args.traceback or str(getattr(args, "loglevel", "")).upper() == "DEBUG"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns its exit status. An operational error (:func:`weir.errors.one_line`)
    is one line on stderr and exit status 2 (1 for a batch stored but not all published); Ctrl-C
    is 130 once the command has shut down."""
    from weir.errors import one_line
    from weir.jobs.client import PublishError

    started_s = _process_started_s()  # weir enrich's wall time counts from here
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    args.started_s = started_s
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _wants_traceback(args):
            raise
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `weir batches | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if _wants_traceback(args):
            raise
        settings = _settings_or_none()
        line = one_line(exc, database_url=settings.database.url() if settings else None,
                        broker_url=settings.worker.broker_url if settings else None)
        if line is None:
            raise
        name = " ".join(filter(None, [args.command, getattr(args, "db_command", None),
                                    getattr(args, "batch_command", None)]))
        print(f"weir {name}: {line}", file=sys.stderr)
        return EXIT_FAILED if isinstance(exc, PublishError) else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
