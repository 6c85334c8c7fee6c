"""A thread-safe front for the engine: many producer threads, one step-loop thread."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Callable

from weir.engine.llm import LLM, PromptType
from weir.engine.llm_engine import EngineStepError
from weir.engine.outputs import calibrate
from weir.engine.sampling_params import SamplingParams
from weir.model_source import prompt_text

logger = logging.getLogger(__name__)

__all__ = ["EngineFront", "EngineStepError"]


def _resolve(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Set a future's result or error, unless its caller cancelled it first."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except InvalidStateError:  # cancelled by the caller in the meantime
        pass


class EngineFront:
    """Runs ``llm``'s engine step loop in one background thread and hands out futures.

    Any thread may call ``submit_generate``/``submit_classify``; the work is queued, picked up
    between steps, and the returned ``concurrent.futures.Future`` resolves to the
    ``RequestOutput``/``ClassificationOutput`` (or raises the request's error, e.g. ValueError for
    a prompt that is too long). Prompts are tokenized in the calling thread, so bad input fails
    there at once.

    The engine itself is touched only by the loop thread. A step whose execute raises fails the
    requests of that step with :class:`EngineStepError` (retryable) and the others carry on; any
    other error in the loop fails every request in flight with it. :attr:`consecutive_step_failures`
    counts failed steps since the last good one (a sticky device error keeps it growing). A future
    the caller cancels aborts its request.
    """

    def __init__(self, llm: LLM, name: str = "weir-engine"):
        self.llm = llm
        self._engine = llm.llm_engine
        self._cv = threading.Condition()
        self._inbox: deque[tuple[Callable[[], str], Future]] = deque()
        self._aborts: deque[str] = deque()
        self._futures: dict[str, Future] = {}
        self._priors: dict[tuple, Future] = {}
        self._stopping = False
        self._drain = True
        self._ids = itertools.count()
        self._tok_lock = threading.Lock()
        self._stats: dict = self._engine.stats()
        self.consecutive_step_failures = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- producer side ----------------------------------------------------------------------

    def _submit(self, add: Callable[[str], str], prefix: str) -> Future:
        fut: Future = Future()
        rid = f"{prefix}-{next(self._ids)}"
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._inbox.append((lambda: add(rid), fut))
            self._cv.notify()
        fut.request_id = rid  # lets a caller abort it
        fut.add_done_callback(self._abort_if_cancelled)
        return fut

    def _abort_if_cancelled(self, fut: Future) -> None:
        if fut.cancelled():
            with self._cv:
                self._aborts.append(fut.request_id)
                self._cv.notify()

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids, as :meth:`submit_generate` makes them (safe from any thread).

        Raises:
            ValueError: the prompt is malformed or empty.
        """
        with self._tok_lock:
            return self.llm.encode_prompt(prompt)

    def submit_generate(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> Future:
        """Queue one generation; the future gives a ``RequestOutput``. ``priority``: as
        ``LLMEngine.add_request``'s.

        Raises:
            ValueError: the prompt is empty or too long, ``structured_outputs`` cannot be
                compiled, or the priority is refused (raised here, nothing is queued).
            RuntimeError: the front is shutting down.
        """
        self._engine.check_priority(priority)
        with self._tok_lock:  # tokenizers are not guaranteed thread-safe
            ids = self.llm.encode_prompt(prompt)
        if params.structured_outputs is not None:
            # compiled here, in the caller's thread, so that the step loop finds it cached
            self._engine.structured_outputs.compile(params.structured_outputs)
        text = prompt_text(prompt)
        return self._submit(lambda rid: self._engine.add_request(ids, params, rid, text, priority=priority), "gen")

    def submit_classify(self, prompt: PromptType, labels: list[str], label_texts: list[str] | None = None,
                        calibration_prompt: PromptType | None = None, priority: int = 0) -> Future:
        """Queue choice scoring of ``labels`` (arguments as in ``LLM.classify``); the future gives
        a ``ClassificationOutput``. A calibration prior is computed once per (calibration prompt,
        label set) and reused by every later request with the same pair (computed at the priority
        of the first request that needs it).

        Raises:
            ValueError: empty labels, empty or too long prompt, a refused priority (raised here).
        """
        self._engine.check_priority(priority)
        with self._tok_lock:
            ids = self.llm.encode_prompt(prompt)
            label_ids = self.llm.encode_labels(labels, label_texts)
            cal_ids = None if calibration_prompt is None else self.llm.encode_prompt(calibration_prompt)
        fut = self._submit(lambda rid: self._engine.add_classification(ids, labels, label_ids, rid, priority=priority),
                           "cls")
        if cal_ids is None:
            return fut
        key = (tuple(cal_ids), tuple(labels), tuple(map(tuple, label_ids)))
        with self._cv:
            prior = self._priors.get(key)
        if prior is None or (prior.done() and prior.exception() is not None):
            prior = self._submit(lambda rid: self._engine.add_classification(cal_ids, labels, label_ids, rid,
                                                                             priority=priority), "cal")
            with self._cv:
                self._priors[key] = prior
        out: Future = Future()
        out.request_id = fut.request_id
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
        with self._cv:
            self._aborts.append(future.request_id)
            self._cv.notify()

    def stats(self) -> dict:
        """The engine's counters as of the last step (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop the loop. ``drain=True`` finishes everything submitted first; otherwise pending
        futures fail with RuntimeError."""
        with self._cv:
            self._stopping = True
            self._drain = drain
            self._cv.notify()
        self._thread.join(timeout_s)

    # ---- loop side --------------------------------------------------------------------------

    def _loop(self) -> None:
        eng = self._engine
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or self._stopping or eng.has_unfinished()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, deque()
                aborts, self._aborts = self._aborts, deque()
                stopping, drain = self._stopping, self._drain
            for add, fut in inbox:
                if fut.cancelled():
                    continue
                try:
                    self._futures[add()] = fut
                except Exception as e:  # bad request: fail it, keep serving the rest
                    _resolve(fut, error=e)
            for rid in aborts:
                eng.abort(rid)
                fut = self._futures.pop(rid, None)
                if fut is not None:
                    fut.cancel()
            if stopping and (not drain or not eng.has_unfinished()):
                for rid, fut in self._futures.items():
                    eng.abort(rid)
                    _resolve(fut, error=RuntimeError("engine shut down before the request finished"))
                self._futures.clear()
                return
            try:
                outputs = eng.step()
            except EngineStepError as e:
                self._step_failed(e, e.request_ids)
                continue
            except Exception as e:  # a bug outside execute: the engine may be in any state
                error = EngineStepError(f"engine step failed: {type(e).__name__}: {e}", list(self._futures))
                error.__cause__ = e
                self._step_failed(error, list(self._futures))
                continue
            self.consecutive_step_failures = 0
            self._stats = eng.stats()
            for out in outputs:
                fut = self._futures.pop(out.request_id, None)
                if fut is not None:
                    _resolve(fut, out)

    def _step_failed(self, error: EngineStepError, request_ids: list[str]) -> None:
        self.consecutive_step_failures += 1
        logger.error("engine step failed (%d in a row); failing its %d requests",
                     self.consecutive_step_failures, len(request_ids), exc_info=error.__cause__)
        for rid in request_ids:
            try:
                self._engine.abort(rid)  # a no-op for the requests the engine already ended
            except Exception:  # the engine may be in any state after a failed step
                logger.exception("cannot abort %s after a failed step", rid)
            fut = self._futures.pop(rid, None)
            if fut is not None:
                _resolve(fut, error=error)
