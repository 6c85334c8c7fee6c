"""A job's outcome: :class:`JobResult` and the group write of results (:func:`record_results`),
dead letters, and the storage rules for result values. Callers own the session and transaction (an
application's own rows, such as the catalog's, are written by its result projection inside the
same transaction as the results: :data:`weir.jobs.applications.RESULT_PROJECTIONS`).

Result writes are upserts keyed by job id (``INSERT .. ON CONFLICT (id) DO UPDATE .. WHERE``):
a redelivered job never makes a second row, and a finished job is never changed again; only a
``running`` job under the writer's fencing token is finished.

Storage rules for results (the same on Postgres and SQLite): a NUL character (U+0000) in any text
result (generated text, label, error, and every string inside ``completions``, ``parsed`` and
``prompt_logprobs``) is stored as U+FFFD, since Postgres text cannot hold NUL; nothing else
changes and nothing is cut. NaN and Infinity in ``label_probs`` and inside the JSON results (and a
non-finite ``category_confidence``) are stored as null.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Optional

from sqlalchemy import text
from sqlalchemy.orm import Session

from weir.jobs.counters import count_transitions
from weir.jobs.db import MAX_DEAD_LETTER_BODY_CHARS, DeadLetter, Job, JobStatus, utcnow
from weir.jobs.schemas import check_json


NUL_REPLACEMENT = "\ufffd"
"""What a NUL character in a text result is stored as (Postgres text cannot hold U+0000)."""


@dataclass
class JobResult:
    """The outcome of running one job, as the worker hands it to :func:`record_result`.

    ``status`` is ``SUCCEEDED`` or ``FAILED``; a failure carries ``error`` and no output.
    ``label_probs`` maps each label to its probability (summing to 1). ``completions``,
    ``parsed`` and ``prompt_logprobs`` are a generation's, as :class:`weir.jobs.db.Job` describes.
    """

    status: JobStatus
    output_text: Optional[str] = None
    label: Optional[str] = None
    label_probs: Optional[dict[str, float]] = None
    finish_reason: Optional[str] = None
    completions: Optional[list[dict[str, Any]]] = None
    parsed: Any = None
    prompt_logprobs: Optional[list[Any]] = None
    num_prompt_tokens: Optional[int] = None
    num_completion_tokens: Optional[int] = None
    num_cached_tokens: Optional[int] = None
    error: Optional[str] = None

    @classmethod
    def failure(cls, error: str) -> "JobResult":
        return cls(status=JobStatus.FAILED, error=error)

    def storable(self) -> "JobResult":
        """This result under the module's storage rules: NUL -> U+FFFD in text, NaN/Inf -> None."""
        probs = None
        if self.label_probs is not None:
            probs = {_text(k): (v if math.isfinite(v) else None) for k, v in self.label_probs.items()}
        return replace(
            self,
            output_text=_text(self.output_text),
            label=_text(self.label),
            label_probs=probs,
            finish_reason=_text(self.finish_reason),
            completions=_json_value(self.completions),
            parsed=_json_value(self.parsed),
            prompt_logprobs=_json_value(self.prompt_logprobs),
            error=_text(self.error),
        )


def parse_json_output(text: str, finish_reason: Optional[str]) -> Any:
    """The JSON value of a generated text that was asked to be JSON, or None.

    None unless the generation finished as ``"stop"`` (an output cut by ``max_tokens`` or
    ``max_model_len`` is never claimed valid) and the whole text (surrounding whitespace aside) is
    one JSON value that the database can store: NaN and Infinity, which Python's parser accepts,
    are not JSON.
    """
    if finish_reason != "stop":
        return None
    try:
        value = json.loads(text, parse_constant=_not_json)
        check_json(value, "output")
    except ValueError:  # json.JSONDecodeError is one
        return None
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _text(value: Optional[str]) -> Optional[str]:
    return None if value is None else value.replace("\x00", NUL_REPLACEMENT)


def _json_value(value: Any) -> Any:
    """``value`` under the storage rules: NUL -> U+FFFD in every string, NaN/Inf -> None."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {_text(str(k)): _json_value(v) for k, v in value.items()}
    return value


def record_results(session: Session, results: Iterable[tuple[Job, JobResult]]) -> set[uuid.UUID]:
    """Store many jobs' outcomes in one statement, with their batches' counters.

    Each ``job`` is the row as claimed: its ``lease_token`` is the claim's fencing token. A job's
    row takes the outcome only while it is still ``running`` under that same token, so a write
    from a stale attempt (its lease expired and another claim took the job, or the job was
    cancelled, gave up or finished meanwhile) changes nothing: no row, no counter, no enrichment.
    A finished job is never changed again. Each real transition moves its batch's counters by one
    in this transaction, and the batch finishes (``completed``, or ``failed`` when every job
    failed) in the transaction whose transitions bring its counts to ``num_jobs``: exactly once.
    When one job appears more than once in ``results``, a success is kept over a failure, else the
    later one. Results are stored under the module's storage rules (:meth:`JobResult.storable`).

    Returns:
        The ids of the jobs whose row took the given outcome.

    Raises:
        ValueError: an outcome's status is not ``SUCCEEDED`` or ``FAILED``.
    """
    chosen: dict[uuid.UUID, tuple[Job, JobResult]] = {}
    for job, result in results:
        if result.status not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            raise ValueError(f"a worker writes succeeded or failed, not {result.status.value}")
        kept = chosen.get(job.id)
        if kept is None or not (kept[1].status == JobStatus.SUCCEEDED and result.status == JobStatus.FAILED):
            chosen[job.id] = (job, result)
    if not chosen:
        return set()
    now = utcnow()
    dialect = session.get_bind().dialect.name
    rows = []
    for job, result in sorted(chosen.values(), key=lambda item: item[0].id):
        values = asdict(result.storable())
        values["status"] = result.status.value
        rows.append(dict(values, id=uuid_literal(job.id, dialect), lease_token=job.lease_token))
    # One statement for the whole group: the rows travel as one JSON array joined to ``jobs``
    # (compiled once, whatever the group's size), and RETURNING yields a row only where the
    # guarded update applied: one per real transition.
    found = session.execute(_FINISH_SQL[dialect], {"rows": json.dumps(rows), "now": now}).all()
    written = {as_uuid(row[0]) for row in found}
    count_transitions(session, [(as_uuid(row[1]), JobStatus(row[2])) for row in found], now)
    return written


_RESULT_FIELDS = (
    ("status", "text"), ("output_text", "text"), ("label", "text"), ("label_probs", "json"),
    ("finish_reason", "text"), ("completions", "json"), ("parsed", "json"), ("prompt_logprobs", "json"),
    ("num_prompt_tokens", "int"), ("num_completion_tokens", "int"),
    ("num_cached_tokens", "int"), ("error", "text"),
)


_SET_RESULT = ", ".join(f"{name} = v.{name}" for name, _ in _RESULT_FIELDS)


_FINISH_SQL = {
    "postgresql": text(
        f"UPDATE jobs SET {_SET_RESULT}, finished_at = :now, lease_expires_at = NULL "
        "FROM json_to_recordset(CAST(:rows AS json)) AS v(id uuid, lease_token int, "
        + ", ".join(f"{name} {kind}" for name, kind in _RESULT_FIELDS) + ") "
        "WHERE jobs.id = v.id AND jobs.status = 'running' AND jobs.lease_token = v.lease_token "
        "RETURNING jobs.id, jobs.batch_id, jobs.status"
    ),
    "sqlite": text(
        f"UPDATE jobs SET {_SET_RESULT}, finished_at = :now, lease_expires_at = NULL "
        "FROM (SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.lease_token') AS lease_token, "
        + ", ".join(
            f"json_extract(value, '$.{name}') AS {name}" if kind != "json"
            # json_quote: a JSON string stays JSON text (json_extract alone unquotes it)
            else f"CASE WHEN json_type(value, '$.{name}') = 'null' THEN NULL "
                 f"ELSE json_quote(json_extract(value, '$.{name}')) END AS {name}"
            for name, kind in _RESULT_FIELDS) + " FROM json_each(:rows)) AS v "
        "WHERE jobs.id = v.id AND jobs.status = 'running' AND jobs.lease_token = v.lease_token "
        "RETURNING jobs.id, jobs.batch_id, jobs.status"
    ),
}


def uuid_literal(value: uuid.UUID, dialect: str) -> str:
    """How a UUID column stores ``value`` in a statement's JSON rows: Postgres's text form, SQLite's 32 hex digits."""
    return value.hex if dialect == "sqlite" else str(value)


def as_uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def record_dead_letter(
    session: Session,
    *,
    body: Any,
    reason: str,
    queue: Optional[str] = None,
    task: Optional[str] = None,
    message_id: Optional[str] = None,
) -> DeadLetter:
    """Keep a message the worker could not read (added and flushed, not committed).

    Args:
        body: the message body (bytes are decoded as UTF-8 with replacement; other values are
            stored as their ``repr``); cut to ``MAX_DEAD_LETTER_BODY_CHARS`` characters.
        reason: why it was refused, e.g. ``"args must be [job_id], got [42, 'x']"``.
    """
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    elif not isinstance(body, str):
        body = repr(body)
    letter = DeadLetter(
        queue=queue, task=task, message_id=message_id,
        body=_text(body[:MAX_DEAD_LETTER_BODY_CHARS]), reason=_text(reason),
    )
    session.add(letter)
    session.flush()
    return letter
