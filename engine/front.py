"""Thread-safe fronts for the engine: many producer threads, one step loop.

:class:`FrontBase` is what producers call (tokenize in the caller, submit, get a
``concurrent.futures.Future``); :class:`EngineFront` runs the step loop on a thread of this process
(:class:`weir.engine.core.EngineCore`), ``weir.engine.core_client.EngineCoreClient`` in a process of
its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, TimeoutError as FutureTimeout

from weir.engine.core import (AbortCall, ClassifyCall, CoreCall, CoreResult, EngineCore, GenerateCall,
                              ResetPrefixCacheCall)
from weir.engine.input_processor import InputProcessor
from weir.engine.llm import LLM, PromptType
from weir.engine.llm_engine import EngineStepError
from weir.engine.outputs import calibrate
from weir.engine.sampling_params import SamplingParams
from weir.model_source import prompt_text

logger = logging.getLogger(__name__)

__all__ = ["EngineFront", "EngineStepError", "FrontBase", "deadline", "result_after_start", "started_at"]


def started_at(future: Future) -> float | None:
    """When the engine first scheduled a request submitted through a front (``time.monotonic()``
    seconds), or None while it waits in the engine's queue; for a calibrated classification, its
    own request's."""
    return getattr(getattr(future, "request_future", future), "started_at", None)


def deadline(future: Future, timeout_s: float) -> float | None:
    """When a request submitted through a front times out: ``timeout_s`` seconds after the
    engine first scheduled it (``time.monotonic()`` clock), or None while it still waits in the
    engine's queue (behind ``max_num_seqs`` running requests, or higher priorities), which does
    not count."""
    started = started_at(future)
    return None if started is None else started + timeout_s


def result_after_start(future: Future, timeout_s: float, poll_s: float = 0.5):
    """``future.result()``, waiting at most ``timeout_s`` seconds from the moment the engine
    first scheduled the request (:func:`deadline`); the time it waits to be scheduled is not
    limited here (the engine's own liveness checks cover a wedged engine).

    Raises:
        concurrent.futures.TimeoutError: no result ``timeout_s`` seconds after its start.
        Whatever ``future.result()`` raises.
    """
    while True:
        due = deadline(future, timeout_s)
        wait_s = poll_s if due is None else due - time.monotonic()
        if wait_s <= 0 and not future.done():
            raise FutureTimeout()
        try:
            return future.result(timeout=max(wait_s, 0.0))
        except FutureTimeout:
            if due is not None:
                raise


def _resolve(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Set a future's result or error, unless its caller cancelled it first."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except InvalidStateError:  # cancelled by the caller in the meantime
        pass


class FrontBase:
    """The producer side of a step loop: ``submit_generate``/``submit_classify`` from any thread.

    Prompts are tokenized and checked in the calling thread (:class:`InputProcessor`), so bad input
    fails there at once; the work goes to the step loop as a :class:`weir.engine.core.CoreCall`
    (subclasses say how: :meth:`_send`), and the returned future resolves to the
    ``RequestOutput``/``ClassificationOutput`` or raises the request's error (a refused request,
    :class:`EngineStepError` for a failed step). A future the caller cancels aborts its request.
    """

    def __init__(self, processor: InputProcessor):
        self.processor = processor
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._priors: dict[tuple, Future] = {}
        self._stopping = False
        self._ids = itertools.count()
        self._tok_lock = threading.Lock()
        self.consecutive_step_failures = 0

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    # ---- producer side ----------------------------------------------------------------------

    def _send(self, calls: list[CoreCall]) -> None:
        raise NotImplementedError

    def _submit(self, make_call, prefix: str) -> Future:
        fut: Future = Future()
        rid = f"{prefix}-{next(self._ids)}"
        with self._lock:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._futures[rid] = fut
        fut.request_id = rid  # lets a caller abort it
        fut.started_at = None  # time.monotonic() once the engine first schedules it
        self._send([make_call(rid)])
        fut.add_done_callback(self._abort_if_cancelled)
        return fut

    def _abort_if_cancelled(self, fut: Future) -> None:
        if fut.cancelled():
            self._send([AbortCall(fut.request_id)])

    def _mark_started(self, request_ids: list[str]) -> None:
        """Stamp ``started_at`` (``time.monotonic()``, seconds) on the futures of the requests
        the engine has just scheduled for the first time."""
        if not request_ids:
            return
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                fut = self._futures.get(rid)
                if fut is not None:
                    fut.started_at = now

    def _deliver(self, results: list[CoreResult]) -> None:
        """Resolve the futures of the step loop's results (an aborted request's is cancelled)."""
        for rid, output, error in results:
            with self._lock:
                fut = self._futures.pop(rid, None)
            if fut is None:
                continue
            if output is None and error is None:
                fut.cancel()
            else:
                _resolve(fut, output, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            futures, self._futures = self._futures, {}
        for fut in futures.values():
            _resolve(fut, error=error)

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids, as :meth:`submit_generate` makes them (safe from any thread).

        Raises:
            ValueError: the prompt is malformed or empty.
        """
        with self._tok_lock:
            return self.processor.encode_prompt(prompt)

    def encode_prompts(self, prompts: list[PromptType]) -> list[list[int]]:
        """Token ids of many prompts in one tokenizer call, as :meth:`encode_prompt` makes each
        (safe from any thread); the ids are checked when submitted.

        Raises:
            ValueError: a prompt is malformed or empty.
        """
        with self._tok_lock:
            return self.processor.encode_prompts(prompts)

    def submit_generate(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> Future:
        """Queue one generation; the future gives a ``RequestOutput``. ``priority``: as
        ``LLMEngine.add_request``'s.

        Raises:
            ValueError: the prompt is empty or too long, ``structured_outputs`` cannot be compiled,
                or the priority is refused (raised here, nothing is queued). A request the engine
                refuses later (too many logprobs) fails its future with ValueError.
            RuntimeError: the front is shutting down.
        """
        self.processor.check_priority(priority)
        with self._tok_lock:  # tokenizers are not guaranteed thread-safe
            ids = self.processor.encode_prompt(prompt)
        self.processor.check_structured_outputs(params)
        text = prompt_text(prompt)
        return self._submit(lambda rid: GenerateCall(rid, ids, params, text, priority), "gen")

    def submit_classify(self, prompt: PromptType, labels: list[str], label_texts: list[str] | None = None,
                        calibration_prompt: PromptType | None = None, priority: int = 0) -> Future:
        """Queue choice scoring of ``labels`` (arguments as in ``LLM.classify``); the future gives
        a ``ClassificationOutput``. A calibration prior is computed once per (calibration prompt,
        label set) and reused by every later request with the same pair (computed at the priority
        of the first request that needs it).

        Raises:
            ValueError: empty labels, empty or too long prompt, a refused priority (raised here).
        """
        self.processor.check_priority(priority)
        with self._tok_lock:
            ids = self.processor.encode_prompt(prompt)
            label_ids = self.processor.encode_labels(labels, label_texts)
            cal_ids = None if calibration_prompt is None else self.processor.encode_prompt(calibration_prompt)
        fut = self._submit(lambda rid: ClassifyCall(rid, ids, labels, label_ids, priority), "cls")
        if cal_ids is None:
            return fut
        key = (tuple(cal_ids), tuple(labels), tuple(map(tuple, label_ids)))
        with self._lock:
            prior = self._priors.get(key)
        if prior is None or (prior.done() and prior.exception() is not None):
            prior = self._submit(lambda rid: ClassifyCall(rid, cal_ids, labels, label_ids, priority), "cal")
            with self._lock:
                self._priors[key] = prior
        out: Future = Future()
        out.request_id = fut.request_id
        out.request_future = fut  # its start (``deadline``) is the classification request's
        once = threading.Lock()

        def combine(_):
            with once:
                if out.done() or not (prior.done() and fut.done()):
                    return
                try:
                    result = calibrate(fut.result(), prior.result())
                except BaseException as e:  # the request's or the prior's error, or a cancel
                    _resolve(out, error=e)
                else:
                    _resolve(out, result)

        fut.add_done_callback(combine)
        prior.add_done_callback(combine)
        out.add_done_callback(lambda f: f.cancelled() and fut.cancel())
        return out

    def abort(self, future: Future) -> None:
        """Abort a submitted request: its blocks are freed and its future is cancelled."""
        self._send([AbortCall(future.request_id)])

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        """Drop every cached prefix block, between steps (vLLM's ``reset_prefix_cache``); False,
        changing nothing, while requests hold blocks."""
        return self._submit(ResetPrefixCacheCall, "reset").result(timeout=timeout_s)


class EngineFront(FrontBase):
    """Runs ``llm``'s engine step loop in one background thread of this process.

    The engine itself is touched only by the loop thread (:class:`weir.engine.core.EngineCore`:
    a failed step fails its requests with :class:`EngineStepError`, the others carry on).
    :attr:`consecutive_step_failures` counts failed steps since the last good one (a sticky device
    error keeps it growing).
    """

    def __init__(self, llm: LLM, name: str = "weir-engine"):
        super().__init__(llm.processor)
        self.llm = llm
        self.model_name: str = llm.model_name
        self._engine = llm.llm_engine
        # each one's record(SchedulerStats, IterationStats) is called after every step, in the loop
        self.stat_loggers = self._engine.stat_loggers
        self._core = EngineCore(self._engine)
        self._cv = threading.Condition()
        self._inbox: deque[CoreCall] = deque()
        self._drain = True
        self._stats: dict = self._engine.stats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _send(self, calls: list[CoreCall]) -> None:
        with self._cv:
            self._inbox.extend(calls)
            self._cv.notify()

    def stats(self) -> dict:
        """The engine's counters as of the last step (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop the loop. ``drain=True`` finishes everything submitted first; otherwise pending
        futures fail with RuntimeError."""
        with self._lock:
            self._stopping = True
        with self._cv:
            self._drain = drain
            self._cv.notify()
        self._thread.join(timeout_s)

    # ---- loop side --------------------------------------------------------------------------

    def _loop(self) -> None:
        core = self._core
        while True:
            with self._cv:
                while not (self._inbox or self._stopping or core.has_unfinished()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, deque()
                stopping, drain = self._stopping, self._drain
            results = []
            for call in inbox:
                results += core.handle(call)
            self._deliver(results)
            if stopping and (not drain or not core.has_unfinished()):
                self._deliver(core.abort_all(RuntimeError("engine shut down before the request finished")))
                self._fail_all(RuntimeError("engine shut down before the request finished"))
                return
            results = core.step()
            self.consecutive_step_failures = core.consecutive_step_failures
            self._stats = self._engine.stats()
            self._mark_started(core.take_started())
            self._deliver(results)
