"""The engine core: the step loop's side of the engine, requests in and results out as plain data.

vLLM V1's ``EngineCore``: a busy loop over schedule / execute / update that owns the engine, fed
with already tokenized requests and returning finished outputs. :class:`EngineCore` is that loop's
body; it runs on a thread of the caller's process (``weir.engine.front.EngineFront``) or alone in
a process of its own (:func:`run_engine_core`, driven by
``weir.engine.core_client.EngineCoreClient``), so that a busy job side never holds the step loop's
GIL.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from weir.engine.llm_engine import EngineStepError, LLMEngine
from weir.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(EngineStepError):
    """The engine core process died or stopped answering: every request in flight fails with this
    and the engine takes no more (vLLM's ``EngineDeadError``)."""


@dataclass
class GenerateCall:
    """Queue one generation (``LLMEngine.add_request``'s arguments)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str]
    priority: int = 0


@dataclass
class ClassifyCall:
    """Queue choice scoring (``LLMEngine.add_classification``'s arguments)."""

    request_id: str
    prompt_token_ids: list[int]
    labels: list[str]
    label_ids: list[list[int]]
    priority: int = 0


@dataclass
class AbortCall:
    request_id: str


@dataclass
class ResetPrefixCacheCall:
    """Forget every cached prefix block; the result is ``BlockPool.reset_prefix_cache``'s bool."""

    request_id: str


CoreCall = Union[GenerateCall, ClassifyCall, AbortCall, ResetPrefixCacheCall]
# (request id, output or None, error or None); an aborted request has neither
CoreResult = tuple[str, Any, Optional[BaseException]]


class EngineCore:
    """Feeds calls to one :class:`LLMEngine` and steps it. Not thread-safe: one thread owns it.

    A call the engine refuses (bad prompt, refused priority) yields its error as a result at once;
    a step whose execute raises fails that step's requests with :class:`EngineStepError` and the
    others carry on; any other error in a step fails every live request with one.
    :attr:`consecutive_step_failures` counts failed steps since the last good one.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.live: set[str] = set()
        self.consecutive_step_failures = 0

    def handle(self, call: CoreCall) -> list[CoreResult]:
        """Apply one call; the results it ends at once (a refused request; an aborted one)."""
        eng = self.engine
        if isinstance(call, AbortCall):
            eng.abort(call.request_id)
            if call.request_id in self.live:
                self.live.discard(call.request_id)
                return [(call.request_id, None, None)]
            return []
        if isinstance(call, ResetPrefixCacheCall):
            return [(call.request_id, eng.block_pool.reset_prefix_cache(), None)]
        try:
            if isinstance(call, GenerateCall):
                eng.add_request(call.prompt_token_ids, call.params, call.request_id, call.prompt,
                                priority=call.priority)
            else:
                eng.add_classification(call.prompt_token_ids, call.labels, call.label_ids, call.request_id,
                                       priority=call.priority)
        except Exception as exc:  # a bad request: fail it, keep serving the rest
            return [(call.request_id, None, exc)]
        self.live.add(call.request_id)
        return []

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[CoreResult]:
        """One engine step; the results of the requests it finished or failed."""
        try:
            outputs = self.engine.step()
        except EngineStepError as exc:
            return self._step_failed(exc, exc.request_ids)
        except Exception as exc:  # a bug outside execute: the engine may be in any state
            error = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}", sorted(self.live))
            error.__cause__ = exc
            return self._step_failed(error, sorted(self.live))
        self.consecutive_step_failures = 0
        results = []
        for out in outputs:
            if out.request_id in self.live:
                self.live.discard(out.request_id)
                results.append((out.request_id, out, None))
        return results

    def take_started(self) -> list[str]:
        """The requests the engine scheduled for the first time since the last call (their time
        in its waiting queue is over; a caller's timeout may count from now), the ones a step
        also finished included."""
        return self.engine.scheduler.take_first_scheduled()

    def abort_all(self, error: BaseException) -> list[CoreResult]:
        """Abort every live request; each fails with ``error``."""
        results = []
        for rid in sorted(self.live):
            self.engine.abort(rid)
            results.append((rid, None, error))
        self.live.clear()
        return results

    def _step_failed(self, error: EngineStepError, request_ids: list[str]) -> list[CoreResult]:
        self.consecutive_step_failures += 1
        logger.error("engine step failed (%d in a row); failing its %d requests",
                     self.consecutive_step_failures, len(request_ids), exc_info=error.__cause__)
        results = []
        for rid in request_ids:
            try:
                self.engine.abort(rid)  # a no-op for the requests the engine already ended
            except Exception:  # the engine may be in any state after a failed step
                logger.exception("cannot abort %s after a failed step", rid)
            if rid in self.live:
                self.live.discard(rid)
                results.append((rid, None, error))
        return results


# ---- the engine core process ------------------------------------------------------------------

# Messages from the client: a list of CoreCall, or ("shutdown", drain). To the client:
# ("ready", info), ("failed", error), and per step ("step", results, stats records, engine stats,
# consecutive step failures, ids of the requests the step scheduled for the first time).
HEARTBEAT_S = 1.0
"""While requests are in flight the core sends a message at least this often, even when no step
finished a request; the client reads a longer silence as a wedged core."""


class _StatsBuffer:
    """A stat logger that keeps each step's records for the next message to the client."""

    def __init__(self) -> None:
        self.records: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


def picklable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError naming it (for the pipe to the client)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _picklable(results: list[CoreResult]) -> list[CoreResult]:
    return [(rid, out, None if err is None else picklable_error(err)) for rid, out, err in results]


PROCESS_NAME = "weir-engine"
"""The engine core process's name in ``ps``, ``top`` and ``/proc/<pid>/comm`` (Linux)."""


def _set_process_name(name: str) -> None:
    """Name this process ``name`` where the platform allows (Linux's ``prctl(PR_SET_NAME)``)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def freeze_gc_heap() -> None:
    """Collect garbage once, then move every object alive now out of the cyclic garbage
    collector's view (``gc.freeze``), as vLLM's engine core does once it has started.

    A process that has imported torch and transformers and built an engine holds hundreds of
    thousands of long-lived objects, and each full collection (which the requests, outputs and
    rows made per job keep triggering) walks all of them: about a quarter of the engine's host time
    per classify job on a CPU (``python -m bench.host_cost --gc-freeze``). Frozen objects are never
    collected, so call this only in a process whose start-up objects live as long as it does (the
    engine core process, a ``weir worker``), never in a library caller's process. The heap is
    unfrozen at exit, so that the interpreter's finalization still sees every object (extension
    modules report objects it could not free as leaks).
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def run_engine_core(conn, engine_args: dict, collect_stats: bool, num_threads: Optional[int],
                    cpu_affinity: Optional[list[int]] = None) -> None:
    """The engine core process's main: build the engine, then loop until told to stop or until
    the client's end of ``conn`` closes (the worker died).

    Args:
        conn: this process's end of a ``multiprocessing`` pipe to the client.
        engine_args: :class:`weir.engine.engine_args.EngineArgs` fields.
        collect_stats: attach a stat logger and send its records with each step.
        num_threads: ``torch.set_num_threads`` for the step loop (None: torch's default).
        cpu_affinity: the CPUs this process may run on (None: all).
    """
    import torch

    from weir.engine.engine_args import EngineArgs

    # The client owns this process's lifetime (a shutdown call, or its end of the pipe closing): a
    # Ctrl-C sent to the terminal's process group reaches this process too, and must not kill it
    # under a client that is still shutting down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_process_name(PROCESS_NAME)
    if cpu_affinity:
        os.sched_setaffinity(0, cpu_affinity)
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        engine = LLMEngine(EngineArgs(**engine_args))
    except BaseException as exc:
        conn.send(("failed", picklable_error(exc)))
        return
    stats = _StatsBuffer()
    if collect_stats:
        engine.stat_loggers.append(stats)
    freeze_gc_heap()
    conn.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                         "vocab_size": engine.config.vocab_size, "scheduling_policy": engine.scheduler.policy,
                         "stats": engine.stats()}))
    core = EngineCore(engine)
    stopping, drain = False, True
    last_sent = time.monotonic()
    try:
        while True:
            results: list[CoreResult] = []
            busy = core.has_unfinished()
            # block for the next call when idle; between steps, take whatever has arrived
            if conn.poll(None if not busy and not stopping else 0):
                while True:
                    message = conn.recv()
                    if isinstance(message, tuple) and message[0] == "shutdown":
                        stopping, drain = True, message[1]
                    else:
                        for call in message:
                            results += core.handle(call)
                    if not conn.poll(0):
                        break
            if stopping and (not drain or not core.has_unfinished()):
                results += core.abort_all(RuntimeError("engine shut down before the request finished"))
                conn.send(("step", _picklable(results), stats.records, engine.stats(), 0, []))
                return
            started: list[str] = []
            if core.has_unfinished():
                results += core.step()
                started = core.take_started()
            now = time.monotonic()
            if results or started or stats.records or now - last_sent >= HEARTBEAT_S:
                conn.send(("step", _picklable(results), stats.records, engine.stats(),
                           core.consecutive_step_failures, started))
                stats.records = []
                last_sent = now
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the client is gone: nothing is waiting for these requests
