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


GRAPH_MODES = ("cudagraph_full", "cudagraph_piecewise", "eager")


def cudagraph_shares(stats: dict) -> dict:
    """Shares of the steps, tokens and forward time of each graph mode, from ``LLMEngine.stats()``
    (``weir.engine.cudagraph_stats``): ``{"steps": {mode: share}, "tokens": ..., "gpu_time": ...}``;
    ``gpu_time`` only where the engine measured it (``measure_step_gpu_time``), each share 0 when
    the total is 0."""
    kinds = {"steps": "num_steps_{}", "tokens": "num_tokens_{}", "gpu_time": "forward_gpu_time_s_{}"}
    out = {}
    for kind, key in kinds.items():
        if key.format("eager") not in stats:
            continue
        values = {m: stats[key.format(m)] for m in GRAPH_MODES}
        total = sum(values.values())
        out[kind] = {m: (v / total if total else 0.0) for m, v in values.items()}
    return out


def cudagraph_share_line(stats: dict) -> str:
    """One report line: the share of steps, tokens and GPU time under a CUDA graph (full +
    piecewise), each split by mode."""
    parts = []
    for kind, share in cudagraph_shares(stats).items():
        graphs = share["cudagraph_full"] + share["cudagraph_piecewise"]
        parts.append(f"{kind.replace('_', ' ')} {graphs:.1%} (full {share['cudagraph_full']:.1%}, "
                     f"piecewise {share['cudagraph_piecewise']:.1%})")
    return f"{'under a CUDA graph':<24} " + "; ".join(parts)
