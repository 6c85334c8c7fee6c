"""The engine in a process of its own, fed from this one (vLLM V1's ``EngineCoreClient``).

The engine core process (:func:`weir.engine.core.run_engine_core`) owns the model and runs the
step loop; this process tokenizes, sends calls and resolves futures. The two share no GIL, so a
busy job side (Celery's consumer, claims, group commit, leases, metrics) cannot slow a step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from weir.engine.core import CoreCall, EngineDeadError
from weir.engine.core_process import start_core_process
from weir.engine.front import FrontBase
from weir.engine.input_processor import InputProcessor

logger = logging.getLogger(__name__)

DEFAULT_ITERATION_TIMEOUT_S = 60.0
"""Seconds without a word from a busy engine core after which it is taken for wedged and killed
(vLLM's ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` is 60 too)."""


def _load_tokenizer(engine_args: dict):
    """The tokenizer the engine core loads for these arguments (None with no tokenizer)."""
    from weir.model_source import load_tokenizer, resolve_model

    model = engine_args.get("model")
    if engine_args.get("skip_tokenizer_init") or not isinstance(model, (str, type(None))):
        return None
    return load_tokenizer(resolve_model(engine_args.get("tokenizer") or model))


class EngineCoreClient(FrontBase):
    """Starts an engine core process for ``engine_args`` and feeds it (``FrontBase``'s API).

    Args:
        engine_args: :class:`weir.engine.engine_args.EngineArgs` fields (picklable).
        collect_stats: send each step's stats records back; :attr:`stat_loggers` replay them.
        num_threads: intra-op threads of the engine core's torch (None: torch's default).
        cpu_affinity: CPUs the engine core may run on (None: all).
        iteration_timeout_s: a busy core silent this long is killed as wedged.
        started: ``(process, connection)`` from :func:`weir.engine.core_process.start_core_process`
            called with the same arguments (it then owns both); None: it starts the process itself.

    Raises:
        RuntimeError: the engine core process died before it was ready.
        FileNotFoundError, ValueError: the engine refused the arguments (its own error, raised here).

    :attr:`dead` is set the moment the core process dies (its pipe closes) or is killed as wedged;
    every request in flight then fails with :class:`weir.engine.core.EngineDeadError` and new ones
    are refused with it.
    """

    def __init__(self, engine_args: dict, *, collect_stats: bool = False, num_threads: Optional[int] = None,
                 cpu_affinity: Optional[list[int]] = None,
                 iteration_timeout_s: float = DEFAULT_ITERATION_TIMEOUT_S, started: Optional[tuple] = None):
        if started is None:
            started = start_core_process(engine_args, collect_stats=collect_stats, num_threads=num_threads,
                                         cpu_affinity=cpu_affinity)
        self.process, self._conn = started
        try:
            tokenizer = _load_tokenizer(engine_args)  # while the core loads the model
            kind, info = self._receive_ready()
        except BaseException:
            self._kill()
            raise
        if kind == "failed":
            self.process.join(10)
            raise info
        super().__init__(InputProcessor(tokenizer, info["max_model_len"], info["vocab_size"],
                                        info["scheduling_policy"]))
        self.model_name: str = info["model_name"]
        self.stat_loggers: list = []
        self.dead: Optional[EngineDeadError] = None
        self._stats: dict = info["stats"]
        self._send_lock = threading.Lock()
        self._iteration_timeout_s = iteration_timeout_s
        self._receiver = threading.Thread(target=self._receive, name="weir-engine-client", daemon=True)
        self._receiver.start()

    def _receive_ready(self):
        while not self._conn.poll(0.5):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with status {self.process.exitcode} "
                                   "before it was ready")
        return self._conn.recv()

    def stats(self) -> dict:
        """The engine's counters as of the core's last message (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    def _send(self, calls: list[CoreCall]) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            with self._send_lock:
                self._conn.send(calls)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._died("its pipe closed")
            raise self.dead from None

    def shutdown(self, drain: bool = True, timeout_s: Optional[float] = None) -> None:
        """Stop the core: ``drain=True`` finishes everything submitted first; otherwise pending
        futures fail with RuntimeError. Returns once the core process has exited (or after
        ``timeout_s``, when it is killed)."""
        with self._lock:
            self._stopping = True
        if self.dead is None:
            try:
                with self._send_lock:
                    self._conn.send(("shutdown", drain))
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
        self._receiver.join(timeout_s)
        self.process.join(5 if timeout_s is None else max(timeout_s, 0.1))
        if self.process.is_alive():
            self._kill()

    # ---- receiving side ---------------------------------------------------------------------

    def _receive(self) -> None:
        last = time.monotonic()
        while True:
            try:
                ready = self._conn.poll(1.0)
                if not ready:
                    with self._lock:
                        waiting = bool(self._futures)
                    if not self.process.is_alive():
                        self._died(f"it exited with status {self.process.exitcode}")
                        return
                    if waiting and time.monotonic() - last > self._iteration_timeout_s:
                        self._kill()
                        self._died(f"it sent nothing for {self._iteration_timeout_s:g} s with requests "
                                   "in flight (wedged); it was killed")
                        return
                    if not waiting:
                        last = time.monotonic()
                    continue
                kind, results, records, stats, failures, started = self._conn.recv()
            except (EOFError, OSError):
                if self._stopping and not self._futures:
                    return
                self.process.join(5)
                self._died(f"it exited with status {self.process.exitcode}")
                return
            last = time.monotonic()
            self._stats = stats
            self.consecutive_step_failures = failures
            for scheduler_stats, iteration_stats in records:
                for stat_logger in self.stat_loggers:
                    stat_logger.record(scheduler_stats, iteration_stats)
            self._mark_started(started)
            self._deliver(results)

    def _died(self, why: str) -> None:
        if self.dead is None:
            self.dead = EngineDeadError(f"the engine core process died: {why}")
            logger.critical("%s", self.dead)
        self._fail_all(self.dead)

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
