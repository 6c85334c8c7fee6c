"""What the engine reports about its steps, after vLLM V1's ``SchedulerStats``/``IterationStats``
and stat loggers.

After every step an :class:`~weir.engine.llm_engine.LLMEngine` with stat loggers
(``engine.stat_loggers``) calls each one's ``record(scheduler_stats, iteration_stats)``: the
state after the step and what changed since the previous record. With no stat logger the step
builds neither. A logger runs in the engine's step thread, so ``record`` must be cheap (a few
counter increments per step, one histogram observation per finished request); the Prometheus
logger is ``weir.worker.metrics.PrometheusStatLogger``.

:class:`LoggingStatLogger` is the other half of vLLM's pair, the periodic log line. It needs no
``record``: it reads successive ``LLMEngine.stats()`` snapshots (``EngineFront.stats()`` from any
thread), so it costs the step loop nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after a step.

    Attributes:
        num_running_reqs: sequences in ``running`` (a request with ``n`` samples counts ``n`` once forked).
        num_waiting_reqs: sequences in ``waiting`` (preempted ones included).
        kv_cache_usage: fraction of KV blocks in use (ref count > 0), in [0, 1].
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass(slots=True)
class FinishedRequestStats:
    """Durations (seconds) of one finished generation request, from its arrival: to its first
    scheduling (``queue_time_s``), its first token (``time_to_first_token_s``) and its end
    (``e2e_latency_s``). A request aborted before it ran has None for what it never reached."""

    queue_time_s: Optional[float]
    time_to_first_token_s: Optional[float]
    e2e_latency_s: Optional[float]


@dataclass(slots=True)
class IterationStats:
    """What changed since the previous record (tokens unless stated).

    Attributes:
        num_prompt_tokens: prompt tokens of the requests queued (once per request, whatever its
            ``n``, or its labels for a classification; as ``LLMEngine.stats()`` counts them).
        num_generation_tokens: tokens of the generation sequences that finished.
        num_preemptions: sequences preempted (their blocks freed, to be recomputed).
        prefix_cache_queries: tokens of the requests looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found there.
        finished_requests: one entry per generation request whose output was made.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLoggerBase(Protocol):
    """What the engine calls after every step, in its step thread."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


LOG_LINE = ("Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} "
            "tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {kv:.1f}%, "
            "Prefix cache hit rate: {hit_rate:.1f}%")
"""vLLM's periodic line (``LoggingStatLogger``), ``GPU`` left out of "KV cache usage": weir runs on CPUs too."""


class LoggingStatLogger:
    """vLLM's periodic stats line, from successive ``LLMEngine.stats()`` snapshots.

    Each :meth:`log` covers the time since the previous one (or since construction): average
    prompt and generation throughput (tokens/s), the running and waiting requests and the KV cache
    usage now, and the share of the prefix-cache queries' tokens that hit. It logs at INFO, or at
    DEBUG when this window and the previous one were both idle (no tokens, nothing queued), so an
    idle worker does not repeat the same line.

    Args:
        stats: returns an ``LLMEngine.stats()`` dict (``EngineFront.stats`` is safe from any thread).
        clock: seconds, monotonic (a test's fake clock).
    """

    def __init__(self, stats: Callable[[], dict], clock: Callable[[], float] = time.monotonic):
        self._stats = stats
        self._clock = clock
        self._last = stats()
        self._last_time = clock()
        self._last_idle = False

    def log(self) -> str:
        """Log the line for the window since the previous call, and return it."""
        now, stats = self._clock(), self._stats()
        last, elapsed_s = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now

        def delta(key: str) -> int:
            return stats[key] - last[key]

        queries = delta("prefix_cache_queries")
        line = LOG_LINE.format(
            prompt=delta("num_prompt_tokens") / elapsed_s,
            generation=delta("num_generation_tokens") / elapsed_s,
            running=stats["num_requests_running"], waiting=stats["num_requests_waiting"],
            kv=100.0 * stats["kv_cache_usage_perc"],
            hit_rate=100.0 * delta("prefix_cache_hits") / queries if queries else 0.0,
        )
        idle = not (delta("num_prompt_tokens") or delta("num_generation_tokens")
                    or stats["num_requests_running"] or stats["num_requests_waiting"])
        logger.log(logging.DEBUG if idle and self._last_idle else logging.INFO, "%s", line)
        self._last_idle = idle
        return line
