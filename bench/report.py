"""How every benchmark reports a figure: a line for people on stdout and, with ``--json``, one
JSON object a line appended to a file, the run's fixed fields first."""

from __future__ import annotations

import json
from typing import Any, Optional


class Report:
    """Writes one benchmark run's figures.

    Args:
        json_path: the JSON-lines file to append to; None prints only.
        base: fields every JSON row starts with (workload, n, device ...).
    """

    def __init__(self, json_path: Optional[str] = None, **base: Any):
        self.json_path = json_path
        self.base = base
        self.rows: list[dict] = []

    def emit(self, line: Optional[str] = None, **row: Any) -> dict:
        """Print ``line`` (when given) and record ``{**base, **row}`` (when ``row`` is not empty).

        Returns:
            The recorded row.
        """
        if line is not None:
            print(line, flush=True)
        if not row:
            return {}
        full = {**self.base, **row}
        self.rows.append(full)
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(full) + "\n")
        return full


def matmul_peak_line(peak_gflops: float) -> str:
    """The report line of the measured matmul peak (:func:`bench.roofline.matmul_peak`)."""
    return f"{'matmul peak':<24} {peak_gflops:>8.1f} GFLOP/s"
