"""``weir enrich``: classify, describe and extract the products of a catalog CSV, follow the batch
with a progress bar, print the summary. Registered with the command line under the
``weir.commands`` entry-point group (:data:`weir.jobs.applications.COMMANDS`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from weir.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ensure_schema
from weir.config import Settings, get_settings

DEFAULT_IDLE_WARNING_S = 30.0


def add_enrich_command(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``weir enrich`` through the command line's ``command(name, help)``."""
    enrich = command("enrich", "classify and describe every product of a catalog CSV; print a summary")
    enrich.add_argument("catalog", help="catalog CSV file (header row; columns as the spec names them)")
    enrich.add_argument("--limit", type=int, default=None, help="the first N products only")
    enrich.add_argument("--full", action="store_true",
                        help="enrich every product; by default a product whose content, job spec and model are "
                             "unchanged since its last enrichment is skipped")
    enrich.add_argument("--spec", default=None,
                        help=f"job spec (TOML file, or a shipped spec: {', '.join(shipped_spec_names())}); default: "
                             "columns index, product, brand, description, category")
    enrich.add_argument("--product-col", default=None, help="column of the product name (overrides the "
                                                            "spec's [columns] name)")
    enrich.add_argument("--brand-col", default=None, help="column of the brand (overrides [columns] brand)")
    enrich.add_argument("--category-col", default=None,
                        help="column of the catalog's own category (overrides [taxonomy] column)")
    enrich.add_argument("--description-col", default=None,
                        help="column of the existing description (overrides [columns] description)")
    enrich.add_argument("--id-col", default=None, help="column of the product id (overrides [columns] id)")
    enrich.add_argument("--encoding", default="utf-8",
                        help="the catalog's encoding, a Python text codec name such as latin-1 or cp1252 (default "
                             "utf-8; a byte it cannot decode stops the run, naming the line)")
    enrich.add_argument("--timeout-s", type=float, default=None,
                        help="give up waiting after this many seconds (exit 1; the batch goes on)")
    enrich.add_argument("--idle-warning-s", type=float, default=DEFAULT_IDLE_WARNING_S,
                        help="with a broker: warn once when no job has started after this many seconds and "
                             f"no worker consumes the queue (default {DEFAULT_IDLE_WARNING_S:g}; 0: never)")
    enrich.set_defaults(func=cmd_enrich)


def shipped_spec_names() -> list[str]:
    """``weir.jobs.catalog.spec.shipped_specs()`` without importing the spec module (pydantic) for
    every command."""
    specs_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")
    return sorted(name[:-len(".toml")] for name in os.listdir(specs_dir) if name.endswith(".toml"))


def _warn_if_nothing_consumes(client: Any, idle_s: float) -> None:
    """Print one warning when no worker consumes the client's queue (the batch's jobs are
    waiting ``idle_s`` after being published, none started)."""
    if client.queue_consumers():
        return
    print(f"weir enrich: warning: no job started in {idle_s:g} s and no worker consumes queue "
          f"{client.queue!r}; start one (`weir worker` with the same WEIR_BROKER_URL and WEIR_MODEL "
          "or WEIR_QUEUE); still waiting", file=sys.stderr)


def plan_run(settings: Settings, catalog: Any, full: bool) -> Any:
    """The incremental run's plan (:func:`weir.jobs.catalog.plan_enrichment`), read before any
    worker or model starts."""
    from weir.jobs import names
    from weir.jobs.catalog.enrichment import plan_enrichment
    from weir.jobs.db import engine_for, make_session_factory

    engine = engine_for(settings.database)
    try:
        return plan_enrichment(make_session_factory(engine), catalog, names.model_name(settings.engine.model),
                               full=full)
    finally:
        engine.dispose()


COLUMN_FLAGS = {"id": "--id-col", "name": "--product-col", "category": "--category-col"}
"""The ``weir enrich`` flag naming each role of :meth:`weir.jobs.catalog.spec.JobSpec.required_columns`
(the hint column has none: a job spec names it)."""


def _missing_columns_hint(exc: Any, spec: Optional[str]) -> str:
    """What to do about a catalog lacking columns (:class:`weir.jobs.catalog.MissingColumns`): the
    shipped specs its header fits, the flags naming the missing columns, a job spec."""
    from weir.jobs.catalog.spec import fitting_specs

    fits = [f"the header fits the shipped spec {name} (--spec {name})"
            for name in fitting_specs(exc.header) if name != spec]
    flags = [COLUMN_FLAGS[role] for role in exc.missing if role in COLUMN_FLAGS]
    name_them = (f"name the columns with {', '.join(flags)} or in a job spec" if flags
                 else "name the columns in a job spec")
    return "; or ".join(fits + [f"{name_them} (--spec FILE, layout in jobs/catalog/spec.py)"])


def cmd_enrich(args: argparse.Namespace) -> int:
    """Enqueue a catalog's enrichment batch, follow it with a progress bar, print the summary.

    SIGTERM (what ``timeout``, ``kill``, Docker and systemd send) stops the run as Ctrl-C does: an
    embedded run cancels its batch's unfinished jobs, which nothing would run once it ends."""
    if threading.current_thread() is not threading.main_thread():
        return _enrich(args)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _enrich(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _enrich(args: argparse.Namespace) -> int:
    from weir.jobs.catalog.enrichment import MissingColumns, category_votes, enqueue_catalog, read_catalog, summarize
    from weir.jobs.client import Client
    from weir.jobs.catalog.spec import load_spec
    from weir.progress import progress_bar

    settings = get_settings()
    for name in ("timeout_s", "idle_warning_s"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            print(f"weir enrich: --{name.replace('_', '-')} must be >= 0, got {value:g}", file=sys.stderr)
            return EXIT_USAGE
    if args.limit is not None and args.limit < 1:
        print(f"weir enrich: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return EXIT_USAGE
    try:
        spec = load_spec(args.spec).with_columns(
            name=args.product_col, brand=args.brand_col, description=args.description_col, id=args.id_col)
        if args.category_col is not None:
            spec = spec.model_copy(update={"taxonomy": spec.taxonomy.model_copy(update={"column": args.category_col})})
        catalog = read_catalog(args.catalog, spec, limit=args.limit, encoding=args.encoding)
    except MissingColumns as exc:
        print(f"weir enrich: {exc}; {_missing_columns_hint(exc, args.spec)}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        print(f"weir enrich: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if catalog.absent_columns:
        absent = catalog.absent_columns
        print(f"weir enrich: {args.catalog}: no column {', '.join(map(repr, absent.values()))} (optional): "
              f"prompts leave out the {' and '.join(absent)}", file=sys.stderr)
    skipped = catalog.skipped
    if skipped:
        reasons = ", ".join(f"{count} with {reason}" for reason, count in sorted(skipped.items()))
        print(f"weir enrich: skipped {sum(skipped.values())} rows: {reasons}", file=sys.stderr)
    if not catalog.products:
        print(f"weir enrich: {args.catalog} has no products", file=sys.stderr)
        return EXIT_USAGE

    def run(client: Client) -> Any:
        """Enqueue, wait; the exit status on a failure, else the finished batch's results."""
        client.prompt_checker  # load the tokenizer before the batch's clock starts
        batch_started = time.monotonic()
        try:
            batch_id = enqueue_catalog(client, catalog, plan=plan, votes=votes)
        except ValueError as exc:  # two products with one id, a request the schema refuses
            print(f"weir enrich: {args.catalog}: {' '.join(str(exc).split())}; nothing was stored", file=sys.stderr)
            return EXIT_USAGE
        num_jobs = client.batch_status(batch_id).num_jobs
        print(f"batch {batch_id}: {num_jobs} jobs on queue {client.queue}", file=sys.stderr)
        idle_s = args.idle_warning_s if settings.worker.broker_url and args.idle_warning_s > 0 else None
        try:
            with progress_bar(num_jobs, "enrich") as bar:
                final = client.wait(batch_id, args.timeout_s, progress=bar, idle_s=idle_s,
                                    on_idle=lambda snapshot: _warn_if_nothing_consumes(client, idle_s))
        except TimeoutError as exc:
            print(f"weir enrich: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            if settings.worker.broker_url:
                print(f"weir enrich: interrupted; batch {batch_id} goes on in the workers "
                      f"(`weir cancel {batch_id}` stops it)", file=sys.stderr)
                raise
            # nothing will run the batch once this process ends: cancel what has not finished
            print(f"weir enrich: interrupted; cancelling batch {batch_id}'s unfinished jobs and stopping the "
                  "in-process worker", file=sys.stderr)
            logging.getLogger("weir.worker").setLevel(logging.ERROR)  # the aborts of this cancel
            client.cancel(batch_id)
            raise EmbeddedRunInterrupted(batch_id) from None
        return final, list(client.results(batch_id)), time.monotonic() - batch_started

    def finish(outcome: Any) -> int:
        if isinstance(outcome, int):
            return outcome
        final, results, batch_s = outcome
        summary = summarize(catalog, results, time.monotonic() - args.started_s, plan, batch_s=batch_s, votes=votes)
        print(summary.format())
        return EXIT_OK if final.num_failed == 0 and final.num_cancelled == 0 else EXIT_FAILED

    problem = ensure_schema(settings)
    if problem:
        print(f"weir enrich: {problem}", file=sys.stderr)
        return EXIT_USAGE
    plan = plan_run(settings, catalog, args.full)
    if not plan.todo:
        print(f"weir enrich: nothing to enrich: all {plan.num_unchanged} products are unchanged since their "
              "last enrichment (same content, job spec and model); --full redoes them")
        return EXIT_OK
    try:
        votes = category_votes(catalog, plan.todo)
    except ValueError as exc:
        print(f"weir enrich: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if settings.worker.broker_url:
        client = Client(settings)
        try:
            outcome = run(client)
        finally:
            client.close()
        return finish(outcome)

    from weir.jobs.model_info import PromptChecker
    from weir.model_source import resolve_model
    from weir.worker.app import app
    from weir.worker.embedded import embedded_worker

    model = resolve_model(settings.engine.model)  # a missing model: one line before anything starts
    print(f"weir enrich: no WEIR_BROKER_URL, running an in-process worker; results in {settings.database.url()}",
          file=sys.stderr)
    print(f"weir enrich: loading model {model.name} ({model.location})", file=sys.stderr)
    try:
        with contextlib.ExitStack() as stack:
            try:
                runtime = stack.enter_context(embedded_worker(app, settings))
            except ValueError as exc:  # the engine refused its arguments (the KV cache cannot hold a sequence, ...)
                print(f"weir enrich: the engine cannot start: {exc}; nothing was enqueued", file=sys.stderr)
                return EXIT_USAGE
            processor = runtime.front.processor
            checker = PromptChecker(processor.tokenizer, processor.max_model_len, vocab_size=processor.vocab_size,
                                    max_logprobs=settings.engine.max_logprobs)
            client = Client(settings, celery_app=app, prompt_checker=checker)
            try:
                outcome = run(client)
            finally:
                client.close()
    except EmbeddedRunInterrupted as interrupted:
        _report_interrupted_run(settings, catalog, interrupted.batch_id)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the batch was stored: an interrupted enqueue deletes what it stored
        print("weir enrich: interrupted before its batch was stored; nothing was enqueued", file=sys.stderr)
        return EXIT_INTERRUPTED
    return finish(outcome)


class EmbeddedRunInterrupted(Exception):
    """Ctrl-C stopped an embedded ``weir enrich`` once its batch was stored (and its unfinished jobs
    cancelled); raised through the in-process worker's shutdown."""

    def __init__(self, batch_id: Any) -> None:
        super().__init__(f"batch {batch_id} interrupted")
        self.batch_id = batch_id


def _report_interrupted_run(settings: Settings, catalog: Any, batch_id: Any) -> None:
    """Print the interrupted batch's counts and how many products the next run enriches."""
    from weir.jobs.client import Client

    client = Client(settings)
    try:
        batch = client.batch_status(batch_id)
    finally:
        client.close()
    num_left = len(plan_run(settings, catalog, full=False).todo)
    print(f"weir enrich: batch {batch_id} {batch.status.value}: {batch.num_succeeded} of {batch.num_jobs} jobs "
          f"succeeded, {batch.num_cancelled} cancelled; {num_left} products are left: the same command without "
          "--full enriches only those", file=sys.stderr)
