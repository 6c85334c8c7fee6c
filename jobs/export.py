"""A batch's results as files for other programs: JSON Lines (every field) or CSV (a fixed set).

Both writers stream: one row in memory at a time, whatever the batch's size. The rows are
:meth:`weir.jobs.client.Client.results`'s dicts. ``weir results BATCH --format jsonl|csv`` uses
them; ``docs/downstream.md`` documents the formats.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import tempfile
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterable, Iterator

CSV_COLUMNS = (
    "job_id", "custom_id", "kind", "status", "attempts", "output_text", "finish_reason", "label",
    "label_probs", "parsed", "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens",
    "error", "metadata",
)
"""The CSV's header, in order. ``label_probs``, ``parsed`` and ``metadata`` are compact JSON text;
a null is an empty cell. ``completions`` (all ``n`` samples), ``prompt_logprobs``, ``extensions``,
``sampling_params`` and ``annotations`` are in JSON Lines only."""

_JSON_COLUMNS = frozenset({"label_probs", "parsed", "metadata"})


def write_jsonl(rows: Iterable[dict[str, Any]], out: IO[str]) -> int:
    """Write one JSON object per row and line (UTF-8 text, not ASCII-escaped); returns the rows written."""
    num_rows = 0
    for row in rows:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        num_rows += 1
    return num_rows


def write_csv(rows: Iterable[dict[str, Any]], out: IO[str]) -> int:
    """Write a header of :data:`CSV_COLUMNS`, then one record per row (RFC 4180: CRLF line ends,
    fields quoted where they hold a comma, quote or line break); returns the rows written.

    ``out`` should be opened with ``newline=""`` so that line breaks inside a field stay as they are.
    """
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    num_rows = 0
    for row in rows:
        writer.writerow([_cell(name, row.get(name)) for name in CSV_COLUMNS])
        num_rows += 1
    return num_rows


def _cell(name: str, value: Any) -> Any:
    if value is None:
        return ""
    if name in _JSON_COLUMNS:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return value


WRITERS: dict[str, Callable[[Iterable[dict[str, Any]], IO[str]], int]] = {"jsonl": write_jsonl, "csv": write_csv}
"""The writer of each ``--format``."""


@contextmanager
def atomic_output(path: str, *, overwrite: bool = True) -> Iterator[IO[str]]:
    """A UTF-8 text file that appears at ``path`` only when the block ends without an error.

    It is written as a temporary file in the same folder and renamed over ``path`` at the end, so
    a reader never sees half a file; on an error the temporary file is removed and ``path`` is
    left as it was.

    Args:
        path: the file to write.
        overwrite: replace a file already at ``path``; when False such a file is refused, at
            entry and again just before the rename, and left as it was.

    Raises:
        FileExistsError: ``overwrite`` is False and ``path`` exists (``filename`` is ``path``).
        OSError: ``path`` is a folder, or its folder does not exist or cannot be written (at
            entry, before any row is read).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder")
    if not overwrite:
        _refuse_existing(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=folder)
    try:
        with open(fd, "w", encoding="utf-8", newline="") as out:
            yield out
        os.chmod(temporary, 0o666 & ~_umask())
        if not overwrite:  # a file may have appeared while the rows were written
            _refuse_existing(path)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _refuse_existing(path: str) -> None:
    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
