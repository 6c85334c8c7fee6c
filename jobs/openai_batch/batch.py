"""The batch: its OpenAI fields kept in ``batches.metadata``, its completion window and expiry, and
the OpenAI Batch object read from weir's batch row."""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from weir.jobs import batches
from weir.jobs.db import Batch, BatchStatus, utcnow

MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a batch's metadata."""

META_KEY = "openai_batch"
"""The ``batches.metadata`` key holding a batch's OpenAI fields."""

DEFAULT_COMPLETION_WINDOW = "24h"


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
    unfinished jobs (:func:`weir.jobs.batches.cancel_batch`) and record ``expired_at``.

    Returns:
        True when this call expired it.

    Raises:
        LookupError: no such batch, or not one submitted from a request file.
    """
    now = _aware(now or utcnow())
    batch = batches.get_batch(session, batch_id)
    fields = _fields(batch.meta)
    if batch.status not in (BatchStatus.QUEUED, BatchStatus.IN_PROGRESS) or now < expires_at(batch.created_at, batch.meta):
        return False
    batch = batches.cancel_batch(session, batch_id)
    if batch.status != BatchStatus.CANCELLED:  # it finished meanwhile
        return False
    batch.meta = {**batch.meta, META_KEY: {**fields, "expired_at": unix_seconds(now)}}
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


def unix_seconds(when: Optional[datetime]) -> Optional[int]:
    """``when`` (naive means UTC) as whole Unix seconds, as OpenAI's objects give times; None stays None."""
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
    finished_at = unix_seconds(batch.finished_at)
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
        "created_at": unix_seconds(batch.created_at),
        "in_progress_at": unix_seconds(batch.started_at),
        "expires_at": unix_seconds(expires_at(batch.created_at, batch.metadata)),
        "finalizing_at": None,
        "completed_at": finished_at if status == "completed" else None,
        "failed_at": None,
        "expired_at": fields.get("expired_at"),
        "cancelling_at": finished_at if status in ("cancelled", "expired") else None,
        "cancelled_at": finished_at if status in ("cancelled", "expired") else None,
        "request_counts": {"total": batch.num_jobs, "completed": batch.num_succeeded, "failed": batch.num_failed},
        "metadata": {key: value for key, value in batch.metadata.items() if key != META_KEY},
    }
