"""OpenAI Batch files: read a request file into weir jobs, report a batch as an OpenAI Batch
object, write its results as OpenAI output and error lines.

The request file is JSON Lines, one request per line (OpenAI's Batch API, vLLM ``run-batch``)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}

Every line has exactly ``custom_id`` (unique in the file, 1 to 256 characters), ``method``
(``"POST"``), ``url`` and ``body``; every line has the same ``url`` (a batch has one endpoint).
Blank lines are skipped; line numbers count every line from 1.

Endpoints and how a body maps onto weir's requests (:mod:`weir.jobs.schemas`):

``/v1/chat/completions`` -> ``GenerateRequest`` with ``prompt`` = ``messages`` (roles ``system``,
``user``, ``assistant``; ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts,
joined). ``/v1/completions`` -> ``GenerateRequest`` with ``prompt`` = ``prompt`` (one string).
Both take ``max_tokens`` (or, chat only, ``max_completion_tokens``: give one), ``temperature``,
``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty`` under their own
names; chat's ``logprobs: true`` with ``top_logprobs: k`` is weir's ``logprobs = k`` (the sampled
token plus the top ``k``), completions' ``logprobs: k`` is the same, and the output lists the
``k`` most likely tokens per position, the sampled one among them when it ranks within ``k``, as
OpenAI does (:func:`top_entries`); ``response_format``
(OpenAI's shapes) is weir's own field. vLLM's extra sampling names (``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ...) are taken too.

``/v1/classifications`` (weir's extension, not OpenAI's) -> ``ClassifyRequest``: ``prompt`` (a
string or chat messages), ``labels``, and optionally ``label_texts``, ``calibration_prompt``,
``system_prompt``.

``model`` is optional (as in vLLM); when given it must be the workers' model name (the name
``weir.jobs.names.model_name`` gives ``WEIR_MODEL``, the ``jobs.model`` column's), else the line is
refused. Any other body field is refused by name, and so is ``stream: true``.

A file is taken whole or not at all: :func:`parse_batch_file` reads every line and raises one
:class:`BatchFileError` naming each bad line's number and field (the first
:data:`MAX_REPORTED_ERRORS`, in line order), bad JSON, bad fields and, given the model's
:class:`weir.jobs.model_info.PromptChecker`, prompts that do not fit ``max_model_len`` and limits of
the engine alike; nothing is stored.

The batch keeps its OpenAI fields in ``batches.metadata`` (no column of its own): under the key
:data:`META_KEY` the ``endpoint``, ``input_file_id`` (the file's path), ``completion_window`` and,
once expired, ``expired_at``; the caller's ``--metadata`` pairs beside it, at the top level.

Statuses (:func:`openai_status`): weir ``validating`` -> ``validating``; ``queued`` and
``in_progress`` -> ``in_progress`` (OpenAI has no queued state: the file is valid and waits for
workers); ``completed`` -> ``completed``; ``failed`` (every job failed) -> ``completed`` too, with
``request_counts.failed == total`` (OpenAI's ``failed`` is a file refused at validation, which
weir never stores); ``cancelled`` -> ``cancelled``, or ``expired`` when :func:`expire_if_due`
cancelled it. ``cancelling`` and ``finalizing`` are never reported: a cancel is one transaction,
and the output files are written on request (``weir batch results``), not staged.

Results: ``weir batch results`` writes what OpenAI's ``output_file_id`` and ``error_file_id`` hold,
one :func:`result_line` per finished request in submission order: a succeeded request's in the output
file, a failed, cancelled or expired one's in the error file (never in the output file; by default
:func:`error_file_path`), both written whole even when empty.

Expiry: a batch not finished when its completion window has passed (``created_at +
completion_window``) is expired by the next sweep (:func:`expire_due_batches`, the sweeper's rule
registered by this package; ``weir batch status``, ``cancel`` and ``results`` also call
:func:`expire_if_due` first), as OpenAI does it: its unfinished jobs are cancelled, finished
ones keep their results, and it reads ``expired`` from then on; its cancelled requests appear in
the error file with code ``batch_expired``.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Iterable, Optional

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from weir.jobs import store
from weir.jobs.db import Batch, BatchStatus, Job, JobStatus, utcnow
from weir.jobs.schemas import MAX_CUSTOM_ID_CHARS, ClassifyRequest, GenerateRequest, JobRequest

if TYPE_CHECKING:
    from weir.jobs.model_info import PromptChecker, RequestProblem

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CLASSIFICATIONS = "/v1/classifications"
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, CLASSIFICATIONS)

META_KEY = "openai_batch"
"""The ``batches.metadata`` key holding a batch's OpenAI fields."""

MAX_REPORTED_ERRORS = 10
"""Bad lines named in a :class:`BatchFileError`; the rest are counted."""

CHECK_CHUNK_SIZE = 5_000
"""Requests tokenized per call when a file's lengths are checked."""

DEFAULT_COMPLETION_WINDOW = "24h"
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a batch's metadata."""

_LINE_KEYS = ("custom_id", "method", "url", "body")
_SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
             # vLLM's extra sampling parameters, accepted by its OpenAI server too
             "top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos",
             "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")
_BODY_FIELDS = {
    CHAT_COMPLETIONS: frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "logprobs",
                                 "top_logprobs", "response_format", "stream", *_SAMPLING}),
    COMPLETIONS: frozenset({"model", "prompt", "max_tokens", "logprobs", "response_format", "stream", *_SAMPLING}),
    CLASSIFICATIONS: frozenset({"model", "prompt", "labels", "label_texts", "calibration_prompt", "system_prompt"}),
}


class BatchFileError(ValueError):
    """A request file refused at validation; nothing was stored.

    Attributes:
        errors: one message per bad line, ``"line N: FIELD: what is wrong"``, at most
            :data:`MAX_REPORTED_ERRORS` of them; or, for a file with no request, the one message
            :data:`NO_REQUEST`.
        num_bad_lines: how many lines were bad in all (0 for a file with no request).
    """

    def __init__(self, path: str, errors: list[str], num_bad_lines: int) -> None:
        more = num_bad_lines - len(errors)
        lines = [f"{path}: {e}" for e in errors]
        if more > 0:
            lines.append(f"{path}: ... and {_lines(more, 'more bad line')}")
        if num_bad_lines:
            lines.append(f"{path}: {_lines(num_bad_lines, 'bad line')}; nothing was stored")
        super().__init__("\n".join(lines))
        self.errors = errors
        self.num_bad_lines = num_bad_lines


NO_REQUEST = "the file holds no request (it is empty or blank); nothing was stored"
"""A :class:`BatchFileError`'s one message for a file with no request."""


def _lines(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class _LineError(ValueError):
    """What is wrong with one line: ``field`` as the line spells it (None: the whole line)."""

    def __init__(self, field: Optional[str], message: str) -> None:
        super().__init__(message if field is None else f"{field}: {message}")


@dataclass(frozen=True)
class BatchFile:
    """A valid request file: its one endpoint and a weir request per line, in file order
    (``custom_id`` carried over)."""

    endpoint: str
    requests: list[JobRequest]


def parse_batch_file(lines: Iterable[str], *, model: str, path: str = "input",
                     checker: Optional["PromptChecker"] = None) -> BatchFile:
    """Read an OpenAI batch request file (module docstring: the line format and the mapping).

    Args:
        lines: the file's lines (an open text file will do).
        model: the workers' model name; a body's ``model`` must equal it.
        path: the file's name in error messages.
        checker: the model's length and limit checks (``Client.prompt_checker``); when given,
            every well-formed line is checked too (:meth:`PromptChecker.problems`), so that a
            prompt too long for ``max_model_len`` is reported with the other bad lines.

    Returns:
        The endpoint and the requests.

    Raises:
        BatchFileError: some line is bad (not JSON, a missing or unknown key, an unsupported
            endpoint, a body field weir refuses, a repeated ``custom_id``, and with ``checker`` a
            request that does not fit or asks for more than the engine allows), or the file has
            no request; the message has one line per bad line (its number and field, in line
            order, e.g. ``line 4: body.messages: prompt has 600 tokens; max_model_len=512 leaves
            no room for output``).
    """
    errors: list[tuple[int, str]] = []  # the first bad lines, (number, message), in line order
    num_bad = 0
    requests: list[JobRequest] = []
    # each request's line, its body's names, and its endpoint when the body gives no max_tokens
    line_names: list[tuple[int, dict[str, str], Optional[str]]] = []
    endpoint: Optional[tuple[str, int]] = None
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = _read_line(text)
            url = line["url"]
            if endpoint is None:
                endpoint = (url, number)
            elif url != endpoint[0]:
                raise _LineError("url", f"{url} differs from line {endpoint[1]}'s {endpoint[0]}; "
                                        "a batch file has one endpoint")
            custom_id = line["custom_id"]
            if custom_id in seen:
                raise _LineError("custom_id", f"{custom_id!r} is already line {seen[custom_id]}'s")
            seen[custom_id] = number
            request, names = _to_request(url, line["body"], custom_id=custom_id, model=model)
            requests.append(request)
            gives_max_tokens = bool({"max_tokens", "max_completion_tokens"} & line["body"].keys())
            line_names.append((number, names, None if gives_max_tokens else url))
        except _LineError as exc:
            num_bad += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append((number, f"line {number}: {exc}"))
    if endpoint is None and not num_bad:
        raise BatchFileError(path, [NO_REQUEST], 0)
    if checker is not None:
        too_long = _problem_lines(checker, requests, line_names)
        num_bad += len(too_long)
        errors = sorted(errors + too_long[:MAX_REPORTED_ERRORS])[:MAX_REPORTED_ERRORS]
    if num_bad:
        raise BatchFileError(path, [message for _, message in errors], num_bad)
    return BatchFile(endpoint=endpoint[0], requests=requests)


def _problem_lines(checker: "PromptChecker", requests: list[JobRequest],
                   line_names: list[tuple[int, dict[str, str], Optional[str]]]) -> list[tuple[int, str]]:
    """(line number, message) of each request the engine would refuse, in line order."""
    found = []
    for start in range(0, len(requests), CHECK_CHUNK_SIZE):
        _, problems = checker.problems(requests[start:start + CHECK_CHUNK_SIZE])
        for (number, names, defaulted), problem in zip(line_names[start:start + CHECK_CHUNK_SIZE], problems):
            if problem is not None:
                found.append((number, f"line {number}: {_problem_text(problem, names, defaulted)}"))
    return found


DEFAULT_MAX_TOKENS = GenerateRequest.model_fields["max_tokens"].default
"""A generation's ``max_tokens`` when its body gives none (16, as OpenAI's completions endpoint)."""

_DEFAULT_MAX_TOKENS_NOTES = {
    COMPLETIONS: f"the line gives no max_tokens: {DEFAULT_MAX_TOKENS} is OpenAI's completions default",
    CHAT_COMPLETIONS: f"the line gives no max_tokens or max_completion_tokens: {DEFAULT_MAX_TOKENS} is weir's "
                      "default",
}


def _problem_text(problem: "RequestProblem", names: dict[str, str], defaulted: Optional[str] = None) -> str:
    """``body.<field>: <message>``, the field and its ``field=value`` in the message spelt as the
    line spells them (``max_completion_tokens``, chat's ``top_logprobs``, chat's ``messages``);
    a ``max_tokens`` the body did not give (``defaulted``: its endpoint) is said to be the default."""
    name = names.get(problem.field, problem.field)
    message = re.sub(rf"(?<![\w.]){re.escape(problem.field)}=", f"{name}=", problem.message)
    if problem.field == "max_tokens" and defaulted in _DEFAULT_MAX_TOKENS_NOTES:
        message += f"; {_DEFAULT_MAX_TOKENS_NOTES[defaulted]}"
    return f"body.{name}: {message}"


def _read_line(text: str) -> dict[str, Any]:
    try:
        line = json.loads(text)
    except ValueError as exc:
        raise _LineError(None, f"not JSON ({exc})") from None
    if not isinstance(line, dict):
        raise _LineError(None, f"a request is a JSON object, not {type(line).__name__}")
    unknown = [key for key in line if key not in _LINE_KEYS]
    if unknown:
        raise _LineError(unknown[0], "unknown key (a line has custom_id, method, url, body)")
    for key in _LINE_KEYS:
        if key not in line:
            raise _LineError(key, "missing")
    custom_id = line["custom_id"]
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise _LineError("custom_id", f"must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if line["method"] != "POST":
        raise _LineError("method", f"must be \"POST\", not {line['method']!r}")
    if line["url"] not in ENDPOINTS:
        raise _LineError("url", f"{line['url']!r} is not supported (one of {', '.join(ENDPOINTS)})")
    if not isinstance(line["body"], dict):
        raise _LineError("body", "must be a JSON object")
    return line


def to_request(url: str, body: dict[str, Any], *, custom_id: str, model: str) -> JobRequest:
    """Map one line's ``body`` for ``url`` onto a weir request (module docstring: the mapping).

    Raises:
        ValueError: the body is refused; the message starts with the field, as the line spells
            it (``body.temperature: ...``, ``body.messages[0].content: ...``).
    """
    return _to_request(url, body, custom_id=custom_id, model=model)[0]


def _to_request(url: str, body: dict[str, Any], *, custom_id: str, model: str) -> tuple[JobRequest, dict[str, str]]:
    """:func:`to_request`, and the body's name of each weir field it sets."""
    unknown = sorted(set(body) - _BODY_FIELDS[url])
    if unknown:
        raise _LineError(f"body.{unknown[0]}", f"not supported for {url}")
    if "model" in body and body["model"] != model:
        raise _LineError("body.model", f"{body['model']!r} is not the workers' model {model!r}")
    if body.get("stream") not in (None, False):
        raise _LineError("body.stream", "a batch request is not streamed")
    fields = {key: value for key, value in body.items() if key not in ("model", "stream")}
    names = {key: key for key in fields}  # weir field -> the body's name for it
    if url == CLASSIFICATIONS:
        return _validated(ClassifyRequest, fields, names, custom_id), names
    if url == CHAT_COMPLETIONS:
        if "messages" not in fields:
            raise _LineError("body.messages", "missing")
        fields["prompt"] = _chat_messages(fields.pop("messages"))
        names["prompt"] = "messages"
        if "max_completion_tokens" in fields:
            if "max_tokens" in fields:
                raise _LineError("body.max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            fields["max_tokens"] = fields.pop("max_completion_tokens")
            names["max_tokens"] = "max_completion_tokens"
        top_logprobs = fields.pop("top_logprobs", None)
        logprobs = fields.pop("logprobs", None)
        if logprobs not in (None, True, False):
            raise _LineError("body.logprobs", "must be true or false")
        if top_logprobs is not None and not logprobs:
            raise _LineError("body.top_logprobs", "needs logprobs: true")
        if logprobs:
            fields["logprobs"] = 0 if top_logprobs is None else top_logprobs
            names["logprobs"] = "top_logprobs" if top_logprobs is not None else "logprobs"
    else:
        if "prompt" not in fields:
            raise _LineError("body.prompt", "missing")
        if not isinstance(fields["prompt"], str):
            raise _LineError("body.prompt", "must be one string (one prompt per request)")
    return _validated(GenerateRequest, fields, names, custom_id), names


def _chat_messages(messages: Any) -> Any:
    """Chat messages with ``content`` parts of type ``text`` joined into one string."""
    if not isinstance(messages, list):
        raise _LineError("body.messages", "must be a list of chat messages ({\"role\": ..., \"content\": ...})")
    joined = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"]
            for j, part in enumerate(parts):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _LineError(f"body.messages[{i}].content[{j}]",
                                     "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            message = {**message, "content": "".join(part["text"] for part in parts)}
        joined.append(message)
    return joined


def _validated(model_cls: type, fields: dict[str, Any], names: dict[str, str], custom_id: str) -> JobRequest:
    try:
        return model_cls.model_validate({**fields, "custom_id": custom_id})
    except ValidationError as exc:
        error = exc.errors()[0]
        raise _LineError(_field_name(error["loc"], names), _message(error)) from None


def _field_name(loc: tuple, names: dict[str, str]) -> str:
    if not loc:
        return "body"
    if loc[0] == "custom_id":
        return "custom_id"
    name = "body." + names.get(str(loc[0]), str(loc[0]))
    for part in loc[1:]:
        if part in ("text", "messages") and name.endswith(("prompt", "messages")):
            continue  # the prompt union's branch tags
        name += f"[{part}]" if isinstance(part, int) else f".{part}"
    return name


def _message(error: dict[str, Any]) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "sampling_params":
        # the engine's message starts with its own field name ("temperature must be ..."): keep the rest
        message = message.split(" ", 1)[1] if " " in message else message
    return message


def parse_completion_window(window: str) -> timedelta:
    """A completion window (``"24h"``, ``"90m"``, ``"3600s"``) as a duration.

    Raises:
        ValueError: not a positive whole number of hours, minutes or seconds.
    """
    match = re.fullmatch(r"([0-9]+)([hms])", window)
    if match is None:
        raise ValueError(f"completion window {window!r} is not a duration like 24h, 90m or 3600s")
    if int(match[1]) == 0:
        raise ValueError(f"completion window {window!r} must be positive (24h, 90m, 3600s)")
    return timedelta(**{ {"h": "hours", "m": "minutes", "s": "seconds"}[match[2]]: int(match[1])})


def check_metadata(metadata: dict[str, Any]) -> None:
    """Check a batch's metadata against OpenAI's rules: at most 16 pairs, string keys of 1 to 64
    characters, string values of at most 512, and no key :data:`META_KEY` (weir's own).

    Raises:
        ValueError: naming the first pair that breaks them.
    """
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata key {key!r} must be a string of 1 to {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS} characters")
    if META_KEY in metadata:
        raise ValueError(f"metadata key {META_KEY!r} is weir's own")


def batch_metadata(endpoint: str, input_file_id: str, completion_window: str,
                   metadata: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The ``batches.metadata`` of a batch submitted from a request file: the caller's pairs and,
    under :data:`META_KEY`, ``endpoint``, ``input_file_id`` and ``completion_window``.

    Raises:
        ValueError: ``completion_window`` does not parse (:func:`parse_completion_window`) or
            ``metadata`` breaks OpenAI's rules (:func:`check_metadata`).
    """
    parse_completion_window(completion_window)
    metadata = dict(metadata or {})
    check_metadata(metadata)
    return {**metadata, META_KEY: {"endpoint": endpoint, "input_file_id": input_file_id,
                                   "completion_window": completion_window}}


def _fields(metadata: dict[str, Any]) -> dict[str, Any]:
    fields = metadata.get(META_KEY)
    if not isinstance(fields, dict):
        raise LookupError("this batch was not submitted from an OpenAI batch file (`weir batch submit`)")
    return fields


def expires_at(created_at: datetime, metadata: dict[str, Any]) -> datetime:
    """When the batch's completion window ends (timezone-aware UTC)."""
    return _aware(created_at) + parse_completion_window(_fields(metadata)["completion_window"])


def expire_if_due(session: Session, batch_id: uuid.UUID, now: Optional[datetime] = None) -> bool:
    """Expire the batch if its completion window has passed before it finished: cancel its
    unfinished jobs (:func:`weir.jobs.store.cancel_batch`) and record ``expired_at``.

    Returns:
        True when this call expired it.

    Raises:
        LookupError: no such batch, or not one submitted from a request file.
    """
    now = _aware(now or utcnow())
    batch = store.get_batch(session, batch_id)
    fields = _fields(batch.meta)
    if batch.status not in (BatchStatus.QUEUED, BatchStatus.IN_PROGRESS) or now < expires_at(batch.created_at, batch.meta):
        return False
    batch = store.cancel_batch(session, batch_id)
    if batch.status != BatchStatus.CANCELLED:  # it finished meanwhile
        return False
    batch.meta = {**batch.meta, META_KEY: {**fields, "expired_at": _unix(now)}}
    session.flush()
    return True


def expire_due_batches(session: Session, *, model: str, now: datetime) -> int:
    """The sweeper's rule (:class:`weir.jobs.sweeper.SweepRule`): expire every unfinished batch of
    ``model`` submitted from a request file whose completion window has passed by ``now``
    (:func:`expire_if_due`), so a batch stops running when its window ends whether or not anyone
    asks for its status. Reads the unfinished batches of the model (a handful), not their jobs.

    Returns:
        How many batches this call expired.
    """
    rows = session.execute(select(Batch.id, Batch.meta).where(
        Batch.model == model, Batch.status.in_((BatchStatus.QUEUED, BatchStatus.IN_PROGRESS)))).all()
    num_expired = 0
    for batch_id, metadata in rows:
        if not isinstance(metadata, dict) or not isinstance(metadata.get(META_KEY), dict):
            continue  # not from a request file
        if expire_if_due(session, batch_id, now):  # it reads the window, and finishes once
            num_expired += 1
    return num_expired


def openai_status(status: BatchStatus, metadata: dict[str, Any]) -> str:
    """OpenAI's name for a batch's status (module docstring: the mapping)."""
    if status == BatchStatus.CANCELLED and "expired_at" in _fields(metadata):
        return "expired"
    return _STATUSES[status]


_STATUSES = {BatchStatus.VALIDATING: "validating", BatchStatus.QUEUED: "in_progress",
             BatchStatus.IN_PROGRESS: "in_progress", BatchStatus.COMPLETED: "completed",
             BatchStatus.FAILED: "completed", BatchStatus.CANCELLED: "cancelled"}


def _aware(when: datetime) -> datetime:
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when  # SQLite hands back naive UTC


def _unix(when: Optional[datetime]) -> Optional[int]:
    return None if when is None else int(_aware(when).timestamp())


def batch_object(batch: Any) -> dict[str, Any]:
    """The OpenAI Batch object of a batch (``openai.types.Batch``'s fields).

    Args:
        batch: a ``weir.jobs.client.BatchProgress`` (``client.batch_status(id)``).

    Returns:
        A JSON-ready dict: ``id`` (weir's batch id), ``object`` ``"batch"``, ``endpoint``,
        ``input_file_id`` (the request file's path), ``completion_window``, ``status``,
        ``created_at``, ``in_progress_at`` (a worker's first start), ``expires_at``,
        ``completed_at`` / ``cancelled_at`` / ``expired_at`` (Unix seconds, null until then),
        ``request_counts`` ``{total, completed, failed}`` (cancelled requests count in neither),
        ``metadata`` (the caller's pairs); ``output_file_id`` and ``error_file_id`` are null
        (``weir batch results`` writes the files).

    Raises:
        LookupError: the batch was not submitted from a request file.
    """
    fields = _fields(batch.metadata)
    status = openai_status(batch.status, batch.metadata)
    finished_at = _unix(batch.finished_at)
    return {
        "id": str(batch.id),
        "object": "batch",
        "endpoint": fields["endpoint"],
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": status,
        "output_file_id": None,
        "error_file_id": None,
        "errors": None,
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(batch.started_at),
        "expires_at": _unix(expires_at(batch.created_at, batch.metadata)),
        "finalizing_at": None,
        "completed_at": finished_at if status == "completed" else None,
        "failed_at": None,
        "expired_at": fields.get("expired_at"),
        "cancelling_at": finished_at if status in ("cancelled", "expired") else None,
        "cancelled_at": finished_at if status in ("cancelled", "expired") else None,
        "request_counts": {"total": batch.num_jobs, "completed": batch.num_succeeded, "failed": batch.num_failed},
        "metadata": {key: value for key, value in batch.metadata.items() if key != META_KEY},
    }


_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}
"""weir's finish reasons in OpenAI's: ``abort`` (cut short past a deadline) reads as ``length``."""


def result_line(job: Job, batch: dict[str, Any]) -> Optional[dict[str, Any]]:
    """One line of the output or error file for a finished job of ``batch`` (its
    :func:`batch_object`: the endpoint, and whether it expired), None for an unfinished job.

    A succeeded job: ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
    "body"}, "error": null}``, the body a ``chat.completion``, a ``text_completion`` or (weir's
    extension) a ``classification`` object, with ``usage`` from the job's token counts. A failed
    job: ``"response": null`` and ``"error": {"code": "job_failed", "message": <the job's
    error>}``; a cancelled one: code ``batch_cancelled`` (``batch_expired`` in an expired batch),
    its message saying whether it was cancelled before it ran or, once a worker had started it
    (``attempts >= 1`` or ``started_at`` set), before it finished. Ids: ``batch_req_<job id hex>`` for the line, the job id for ``request_id``.
    """
    if not job.status.is_finished:
        return None
    endpoint, expired = batch["endpoint"], batch["status"] == "expired"
    line = {"id": f"batch_req_{job.id.hex}", "custom_id": job.custom_id, "response": None, "error": None}
    if job.status == JobStatus.FAILED:
        line["error"] = {"code": "job_failed", "message": job.error or "failed"}
    elif job.status == JobStatus.CANCELLED:
        when = "finished" if job.attempts or job.started_at is not None else "ran"
        line["error"] = ({"code": "batch_expired", "message": f"the batch's completion window passed before "
                          f"this request {when}"} if expired else
                         {"code": "batch_cancelled", "message": f"the batch was cancelled before this request {when}"})
    else:
        line["response"] = {"status_code": 200, "request_id": str(job.id), "body": response_body(job, endpoint)}
    return line


def is_error(line: dict[str, Any]) -> bool:
    """Whether a :func:`result_line` belongs in the error file."""
    return line["error"] is not None


def error_file_path(output_path: str) -> str:
    """Where ``weir batch results`` writes the error file when not told: the output file's path
    with ``.errors`` before its extension (``out.jsonl`` -> ``out.errors.jsonl``; ``out`` ->
    ``out.errors.jsonl``)."""
    root, ext = os.path.splitext(output_path)
    return f"{root}.errors{ext or '.jsonl'}"


def response_body(job: Job, endpoint: str) -> dict[str, Any]:
    """A succeeded job's response body for ``endpoint`` (see :func:`result_line`)."""
    prompt_tokens = job.num_prompt_tokens or 0
    completion_tokens = job.num_completion_tokens or 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if job.num_cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": job.num_cached_tokens}
    common = {"created": _unix(job.finished_at), "model": job.model, "usage": usage}
    if endpoint == CLASSIFICATIONS:
        return {"id": f"clf-{job.id.hex}", "object": "classification", **common,
                "label": job.label, "label_probs": job.label_probs}
    completions = job.completions or [{"index": 0, "text": job.output_text or "",
                                       "finish_reason": job.finish_reason, "logprobs": None}]
    num_top = (job.request or {}).get("logprobs") or 0  # chat's top_logprobs, completions' logprobs
    if endpoint == CHAT_COMPLETIONS:
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "finish_reason": _FINISH_REASONS.get(c["finish_reason"], "stop"),
                    "logprobs": _chat_logprobs(c.get("logprobs"), num_top)} for c in completions]
        return {"id": f"chatcmpl-{job.id.hex}", "object": "chat.completion", **common, "choices": choices}
    choices = [{"index": c["index"], "text": c["text"],
                "finish_reason": _FINISH_REASONS.get(c["finish_reason"], "stop"),
                "logprobs": _completion_logprobs(c.get("logprobs"), num_top)} for c in completions]
    return {"id": f"cmpl-{job.id.hex}", "object": "text_completion", **common, "choices": choices}


def _token(entry: dict[str, Any]) -> str:
    return entry.get("decoded_token") or ""


def top_entries(entries: list[dict[str, Any]], num_top: int) -> list[dict[str, Any]]:
    """The ``num_top`` most likely tokens of one position, most likely first, as OpenAI lists
    them: the sampled token among them when it ranks within ``num_top``.

    ``entries`` is one position as weir stores it (the sampled token, then the top ones it asked
    for, each token once: a sampled token that ranks within them is not repeated).
    """
    sampled, *others = entries
    ranked = others + ([sampled] if sampled["rank"] <= num_top else [])
    return sorted(ranked, key=lambda e: e["rank"])[:num_top]


def _chat_logprobs(logprobs: Optional[list[list[dict[str, Any]]]], num_top: int) -> Optional[dict[str, Any]]:
    """weir's per-token entries (the sampled token, then the top ones) as chat's ``logprobs``,
    ``num_top`` (the line's ``top_logprobs``) entries in each ``top_logprobs``."""
    if logprobs is None:
        return None
    return {"content": [
        {"token": _token(sampled), "logprob": sampled["logprob"], "bytes": list(_token(sampled).encode()),
         "top_logprobs": [{"token": _token(e), "logprob": e["logprob"], "bytes": list(_token(e).encode())}
                          for e in top_entries([sampled, *top], num_top)]}
        for sampled, *top in logprobs]}


def _completion_logprobs(logprobs: Optional[list[list[dict[str, Any]]]], num_top: int) -> Optional[dict[str, Any]]:
    """weir's per-token entries as the legacy completions' ``logprobs`` (``num_top``: the line's
    ``logprobs``, the entries of each ``top_logprobs``)."""
    if logprobs is None:
        return None
    tokens = [_token(sampled) for sampled, *_ in logprobs]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [sampled["logprob"] for sampled, *_ in logprobs],
            "top_logprobs": [{_token(e): e["logprob"] for e in top_entries(entries, num_top)} for entries in logprobs],
            "text_offset": offsets}
