"""Which CPUs the engine core's intra-op threads and the job side's threads run on.

vLLM's CPU backend binds its OpenMP threads to cores of their own (``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_NUM_OF_RESERVED_CPU``) so that the front end's Python does not deschedule one of them
in the middle of a parallel region, where every other thread waits for it. weir does the same
between its two processes: the engine core (the step loop) and the worker's job side (Celery's
consumer, claims, group commit, leases, metrics).

- ``WEIR_CPU_OMP_THREADS_BIND=auto`` (the default): of the CPUs this process may run on, the
  job side keeps ``WEIR_CPU_NUM_OF_RESERVED_CPU`` (the first ones) and the engine core gets the
  rest, one intra-op thread per CPU. With no CPU reserved (the default on hosts of up to
  :data:`SMALL_HOST_CPUS` CPUs, where one reserved CPU would take half the engine's compute or
  more) the engine core may run on every CPU and nothing is bound.
- ``nobind``: no binding; torch's default threads.
- a CPU list (``0-3,8``): the engine core runs on exactly these, the job side on the others.

``OMP_NUM_THREADS``, when set, still caps the engine core's intra-op threads.

The engine core waits for OpenMP work with a short spin (:mod:`weir.engine.openmp`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

SMALL_HOST_CPUS = 2
"""Hosts with at most this many usable CPUs reserve none for the job side by default."""


@dataclass(frozen=True)
class Placement:
    """CPUs of each side (None: unbound) and the engine core's intra-op threads (None: torch's)."""

    engine_cpus: Optional[tuple[int, ...]]
    job_cpus: Optional[tuple[int, ...]]
    engine_threads: Optional[int]

    def describe(self) -> str:
        if self.engine_cpus is None:
            return "engine core unbound"
        job = "the job side unbound" if self.job_cpus is None else f"the job side on CPUs {_format(self.job_cpus)}"
        return f"engine core on CPUs {_format(self.engine_cpus)} ({self.engine_threads} threads), {job}"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """CPU ids of a list such as ``0-3,8`` (sorted, unique).

    Raises:
        ValueError: not a list of ids and ranges, or an empty one.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-3,8)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: the range {part} is empty")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return tuple(sorted(cpus))


def _format(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus))


def _omp_cap() -> Optional[int]:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def plan(bind: str, reserved: Optional[int], available: Optional[tuple[int, ...]] = None) -> Placement:
    """The placement for ``WEIR_CPU_OMP_THREADS_BIND`` and ``WEIR_CPU_NUM_OF_RESERVED_CPU``.

    Args:
        bind: ``auto``, ``nobind`` or a CPU list.
        reserved: CPUs the job side keeps under ``auto`` (None: 0 on hosts of up to
            :data:`SMALL_HOST_CPUS` CPUs, else 1).
        available: the CPUs this process may run on (default: ``os.sched_getaffinity(0)``).

    Raises:
        ValueError: a bad CPU list, CPUs this process may not use, or nothing left for the engine.
    """
    if available is None:
        if not hasattr(os, "sched_getaffinity"):  # not Linux: no binding
            return Placement(None, None, None)
        available = tuple(sorted(os.sched_getaffinity(0)))
    cap = _omp_cap()
    if bind == "nobind":
        return Placement(None, None, None)
    if bind == "auto":
        if reserved is None:
            reserved = 0 if len(available) <= SMALL_HOST_CPUS else 1
        if reserved >= len(available):
            raise ValueError(f"WEIR_CPU_NUM_OF_RESERVED_CPU={reserved} leaves the engine core no CPU "
                             f"(this process may use {len(available)})")
        if reserved == 0:
            return Placement(None, None, min(len(available), cap or len(available)))
        engine = available[reserved:]
        return Placement(engine, available[:reserved], min(len(engine), cap or len(engine)))
    engine = parse_cpu_list(bind)
    outside = sorted(set(engine) - set(available))
    if outside:
        raise ValueError(f"WEIR_CPU_OMP_THREADS_BIND={bind!r} names CPUs this process may not use: "
                         f"{_format(tuple(outside))} (it may use {_format(available)})")
    job = tuple(c for c in available if c not in engine)
    return Placement(engine, job or None, min(len(engine), cap or len(engine)))


def bind_process(cpus: tuple[int, ...]) -> None:
    """Run every thread of this process, and the threads it starts later, on ``cpus`` only."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass
