"""``weir batch``: submit an OpenAI batch request file, follow the batch, write its output and
error files. Registered with the command line under the ``weir.commands`` entry-point group
(:data:`weir.jobs.applications.COMMANDS`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

from weir.cli import EXIT_OK, EXIT_USAGE, ensure_schema, existing_outputs, parse_id
from weir.config import get_settings
from weir.jobs import openai_batch


def add_batch_command(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``weir batch submit|status|cancel|results`` through the command line's ``command(name,
    help)`` (:data:`weir.jobs.applications.COMMANDS`)."""
    batch = command("batch", "OpenAI batch files: submit a request file, follow the batch, write its "
                             "output and error files")
    batch_commands = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    submit = batch_commands.add_parser(
        "submit", help="validate an OpenAI batch request file (JSON Lines) whole, enqueue it, print the batch id")
    submit.add_argument("file", help="request file: one {custom_id, method, url, body} per line; url "
                                     "/v1/chat/completions, /v1/completions or /v1/classifications")
    submit.add_argument("--completion-window", default="24h",
                        help="expire the batch (cancel what has not run) this long after it was created: "
                             "24h, 90m, 3600s (default 24h)")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="a metadata pair kept with the batch (repeatable; at most 16)")
    submit.set_defaults(func=cmd_batch_submit)
    for action, help in (("status", "print the batch as an OpenAI Batch object (JSON)"),
                         ("cancel", "cancel the batch's unfinished requests; print the Batch object")):
        sub = batch_commands.add_parser(action, help=help)
        sub.add_argument("batch_id", help="the batch's id (printed by weir batch submit)")
        sub.set_defaults(func=cmd_batch_status, action=action)
    batch_results = batch_commands.add_parser(
        "results", help="write the batch's output file and error file in OpenAI's line format")
    batch_results.add_argument("batch_id", help="the batch's id (printed by weir batch submit)")
    batch_results.add_argument("--output", metavar="FILE", required=True,
                               help="output file: one line per succeeded request (appears only once complete)")
    batch_results.add_argument("--errors", metavar="FILE", default=None,
                               help="error file: one line per failed, cancelled or expired request, as OpenAI "
                                    "keeps them out of the output file (default: the output file's name with "
                                    ".errors before its extension, out.jsonl -> out.errors.jsonl)")
    batch_results.add_argument("--force", action="store_true",
                               help="replace an existing output or error file (by default either one existing "
                                    "refuses the command, and neither is written)")
    batch_results.set_defaults(func=cmd_batch_results)


def _metadata_pairs(pairs: Sequence[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata {pair!r} is not KEY=VALUE")
        metadata[key] = value
    return metadata


def cmd_batch_submit(args: argparse.Namespace) -> int:
    """Validate an OpenAI batch request file whole, store and publish it as one batch, print its id."""
    from weir.jobs.client import Client

    try:
        metadata = _metadata_pairs(args.metadata)
        openai_batch.check_metadata(metadata)
        openai_batch.parse_completion_window(args.completion_window)
    except ValueError as exc:
        print(f"weir batch submit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    settings = get_settings()
    problem = ensure_schema(settings)
    if problem:
        print(f"weir batch submit: {problem}", file=sys.stderr)
        return EXIT_USAGE
    client = Client(settings)
    try:
        try:  # the model's tokenizer: lengths are checked with the other fields, line by line
            checker = client.prompt_checker
        except (OSError, ValueError):  # no model here: the lines are read all the same, and
            checker = None              # enqueue_batch says what is wrong with the model
        try:
            with open(args.file, encoding="utf-8") as lines:
                batch_file = openai_batch.parse_batch_file(lines, model=client.model, path=args.file,
                                                           checker=checker)
        except openai_batch.BatchFileError as exc:
            for line in str(exc).splitlines():
                print(f"weir batch submit: {line}", file=sys.stderr)
            return EXIT_USAGE
        except (OSError, UnicodeDecodeError) as exc:
            print(f"weir batch submit: cannot read {args.file}: {getattr(exc, 'strerror', None) or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
        meta = openai_batch.batch_metadata(batch_file.endpoint, args.file, args.completion_window, metadata)
        try:
            batch_id = client.enqueue_batch(batch_file.requests, metadata=meta)
        except ValueError as exc:  # a prompt too long for the model, a limit of the engine
            print(f"weir batch submit: {args.file}: {exc}; nothing was stored", file=sys.stderr)
            return EXIT_USAGE
    finally:
        client.close()
    print(batch_id)
    return EXIT_OK


def _openai_batch(client: Any, batch_id: Any) -> dict[str, Any]:
    """The batch's OpenAI Batch object, once expired if its completion window has passed."""
    from weir.jobs.retry import retry_on_conflict

    def expire() -> bool:
        with client.session_factory.begin() as session:
            return openai_batch.expire_if_due(session, batch_id)

    retry_on_conflict(expire)
    return openai_batch.batch_object(client.batch_status(batch_id))


def cmd_batch_status(args: argparse.Namespace) -> int:
    """Print a batch submitted from a request file as an OpenAI Batch object (JSON)."""
    import json

    from weir.jobs.client import Client

    client = Client(get_settings())
    try:
        if args.action == "cancel":
            batch_id = parse_id(args.batch_id)
            _openai_batch(client, batch_id)  # an OpenAI batch, expired if due
            client.cancel(batch_id)
        batch = _openai_batch(client, parse_id(args.batch_id))
    except (LookupError, ValueError) as exc:
        print(f"weir batch {args.action}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        client.close()
    print(json.dumps(batch, indent=2))
    return EXIT_OK


def _output_file(files: Any, path: str, overwrite: bool) -> Any:
    """``export.atomic_output(path, overwrite=overwrite)`` entered on ``files`` (an ``ExitStack``).

    Raises:
        ValueError: the file cannot be created (the message names ``path``).
    """
    from weir.jobs import export

    try:
        return files.enter_context(export.atomic_output(path, overwrite=overwrite))
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None


def cmd_batch_results(args: argparse.Namespace) -> int:
    """Write a batch's output file and error file in OpenAI's line format, in submission order: a
    succeeded request's line in the output file, a failed, cancelled or expired one's in the error
    file (``--errors``, default :func:`weir.jobs.openai_batch.error_file_path`), as OpenAI's
    ``output_file_id`` and ``error_file_id`` hold them. An existing file is refused, before either
    is written, unless ``--force``."""
    import contextlib
    import json

    from weir.jobs.client import Client

    errors_path = args.errors or openai_batch.error_file_path(args.output)
    if os.path.abspath(errors_path) == os.path.abspath(args.output):
        print(f"weir batch results: --errors {errors_path} is the output file; OpenAI keeps them apart",
              file=sys.stderr)
        return EXIT_USAGE
    problem = None if args.force else existing_outputs([args.output, errors_path])
    if problem:
        print(f"weir batch results: {problem}", file=sys.stderr)
        return EXIT_USAGE
    client = Client(get_settings())
    num_output = num_errors = num_unfinished = 0
    try:
        batch_id = parse_id(args.batch_id)
        batch = _openai_batch(client, batch_id)
        with contextlib.ExitStack() as files:
            output = _output_file(files, args.output, args.force)
            errors = _output_file(files, errors_path, args.force)
            for job in client.iter_jobs(batch_id):
                line = openai_batch.result_line(job, batch)
                if line is None:
                    num_unfinished += 1
                    continue
                is_error = openai_batch.is_error(line)
                (errors if is_error else output).write(json.dumps(line) + "\n")
                num_errors += is_error
                num_output += not is_error
    except (LookupError, ValueError) as exc:
        print(f"weir batch results: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"weir batch results: cannot write {exc.filename or args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USAGE
    finally:
        client.close()
    print(f"{num_output} responses in {args.output}, {num_errors} errors in {errors_path}", file=sys.stderr)
    if num_unfinished:
        print(f"weir batch results: batch {batch_id} is {batch['status']}: {num_unfinished} requests not "
              "finished yet are left out", file=sys.stderr)
    return EXIT_OK
