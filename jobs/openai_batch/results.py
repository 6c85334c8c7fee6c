"""Output and error files: one line per finished request, its response body in OpenAI's shape."""

from __future__ import annotations

import os
from typing import Any, Optional

from weir.jobs.db import Job, JobStatus
from weir.jobs.openai_batch.batch import unix_seconds
from weir.jobs.openai_batch.requests import CHAT_COMPLETIONS, CLASSIFICATIONS

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
    common = {"created": unix_seconds(job.finished_at), "model": job.model, "usage": usage}
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
