"""Counters of how each step's forward ran: a full CUDA graph, piecewise graphs, or eagerly.

Per runtime mode (``weir.engine.cuda_graphs.RUNTIME_MODES``) it counts steps, tokens, padding
tokens (rows a graph computed past the step's tokens) and the host wall time spent issuing the
forward (``time.perf_counter``; no synchronisation, so for a graph replay it is launch time, not GPU
time). With ``measure_gpu_time`` it also records a pair of CUDA events around each forward and
sums their elapsed times; the events are read once they have completed (``Event.query``), or at
:meth:`as_dict`, which waits for the last ones (``Event.synchronize``, never the whole device).
"""

from __future__ import annotations

import time

import torch

from weir.engine.cuda_graphs import EAGER, FULL, PIECEWISE, RUNTIME_MODES

STAT_SUFFIX = {FULL: "cudagraph_full", PIECEWISE: "cudagraph_piecewise", EAGER: "eager"}
"""The suffix of each mode's entries in ``LLMEngine.stats()``: ``num_steps_cudagraph_full`` ..."""


class CUDAGraphStats:
    """Owns the per-mode counters and the CUDA events not read yet.

    Args:
        measure_gpu_time: record CUDA events around each forward (CUDA only).
    """

    def __init__(self, measure_gpu_time: bool = False):
        self.measure_gpu_time = measure_gpu_time
        self.num_steps = dict.fromkeys(RUNTIME_MODES, 0)
        self.num_tokens = dict.fromkeys(RUNTIME_MODES, 0)
        self.num_padding_tokens = dict.fromkeys(RUNTIME_MODES, 0)
        self.host_time_s = dict.fromkeys(RUNTIME_MODES, 0.0)
        self.gpu_time_s = dict.fromkeys(RUNTIME_MODES, 0.0)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self):
        """Call before the forward; pass what it returns to :meth:`record`."""
        event = None
        if self.measure_gpu_time:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def record(self, mode: str, num_tokens: int, num_padding_tokens: int, started) -> None:
        """Count one step of ``num_tokens`` tokens run in ``mode`` (after ``num_padding_tokens``
        padding rows), from ``started`` (:meth:`start`) to now.

        Raises:
            KeyError: ``mode`` is not one of ``RUNTIME_MODES``.
        """
        t0, start_event = started
        self.host_time_s[mode] += time.perf_counter() - t0
        self.num_steps[mode] += 1
        self.num_tokens[mode] += num_tokens
        self.num_padding_tokens[mode] += num_padding_tokens
        if start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((mode, start_event, end))
            self._read_events(wait=False)

    def _read_events(self, wait: bool) -> None:
        while self._pending:
            mode, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.gpu_time_s[mode] += start.elapsed_time(end) / 1000
            self._pending.pop(0)

    def as_dict(self) -> dict:
        """``num_steps_<suffix>``, ``num_tokens_<suffix>``, ``num_padding_tokens_<suffix>``,
        ``forward_host_time_s_<suffix>`` and (only with ``measure_gpu_time``)
        ``forward_gpu_time_s_<suffix>`` for each suffix of :data:`STAT_SUFFIX`."""
        out = {}
        if self.measure_gpu_time:
            self._read_events(wait=True)
        for mode, suffix in STAT_SUFFIX.items():
            out[f"num_steps_{suffix}"] = self.num_steps[mode]
            out[f"num_tokens_{suffix}"] = self.num_tokens[mode]
            out[f"num_padding_tokens_{suffix}"] = self.num_padding_tokens[mode]
            out[f"forward_host_time_s_{suffix}"] = self.host_time_s[mode]
            if self.measure_gpu_time:
                out[f"forward_gpu_time_s_{suffix}"] = self.gpu_time_s[mode]
        return out
