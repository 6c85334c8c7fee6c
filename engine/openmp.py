"""How the engine's OpenMP intra-op threads wait for work.

GNU OpenMP's threads spin 300,000 times at each barrier before they sleep. On a host shared with
other busy processes (the worker's job side, a neighbour's job) that spin burns the time slice a
descheduled peer thread needs, and every other thread of the parallel region waits for that peer.
A short spin keeps the quiet speed and gives the CPU back soon enough: ``python -m bench.neighbours``
on 2 CPUs beside two busy processes measured 0.52x a fair share of the host with OpenMP's spin,
0.88-0.90x with ``GOMP_SPINCOUNT`` 1,000-3,000, 0.78x with 10,000 and 1.01x with
``OMP_WAIT_POLICY=PASSIVE``, no setting measurably slower when quiet (BENCHMARKS.md).

GNU OpenMP reads ``GOMP_SPINCOUNT`` once, when torch loads it: :mod:`weir.engine` sets it on import
(so ``from weir import LLM`` before ``import torch`` gets it), and the worker sets it before it
starts its engine core process.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

OMP_SPINCOUNT = "3000"
"""``GOMP_SPINCOUNT`` the engine runs with unless the environment sets it or ``OMP_WAIT_POLICY``."""


def limit_omp_spinning(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set ``GOMP_SPINCOUNT`` to :data:`OMP_SPINCOUNT` in ``environ`` (default ``os.environ``) unless
    it or ``OMP_WAIT_POLICY`` is set there. It takes effect in a process that loads torch after it
    (and in the processes started from it). Returns the spin count the engine will run with (None:
    OpenMP's own choice under ``OMP_WAIT_POLICY``)."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ:
        return environ.get("GOMP_SPINCOUNT")
    return environ.setdefault("GOMP_SPINCOUNT", OMP_SPINCOUNT)
