"""Starting the engine core process, importable without torch: a worker starts its engine core
first, so the core's imports and model load run while the worker's own process is still importing
the job side.

The process runs :func:`weir.engine.core.run_engine_core`; ``weir.engine.core_client.
EngineCoreClient`` drives it.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Optional


def _main(*args: Any) -> None:
    from weir.engine.core import run_engine_core

    run_engine_core(*args)


def start_core_process(engine_args: dict, *, collect_stats: bool = False, num_threads: Optional[int] = None,
                       cpu_affinity: Optional[list[int]] = None):
    """Spawn the engine core for ``engine_args`` (it loads the model at once) and return
    ``(process, connection)``: the ``multiprocessing`` process and this side's end of its pipe,
    for ``EngineCoreClient(..., started=...)``, which owns both from then on. See
    ``EngineCoreClient`` for the arguments."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_main, name="weir-engine-core", daemon=True,
                          args=(child_conn, engine_args, collect_stats, num_threads, cpu_affinity))
    process.start()
    child_conn.close()
    return process, conn
