"""Request files: each line parsed and checked, turned into weir's own requests (the mapping is in
the package docstring, :mod:`weir.jobs.openai_batch`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from pydantic import ValidationError

from weir.jobs.schemas import MAX_CUSTOM_ID_CHARS, ClassifyRequest, GenerateRequest, JobRequest

if TYPE_CHECKING:
    from weir.jobs.model_info import PromptChecker, RequestProblem

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CLASSIFICATIONS = "/v1/classifications"
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, CLASSIFICATIONS)


MAX_REPORTED_ERRORS = 10
"""Bad lines named in a :class:`BatchFileError`; the rest are counted."""

CHECK_CHUNK_SIZE = 5_000
"""Requests tokenized per call when a file's lengths are checked."""


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
