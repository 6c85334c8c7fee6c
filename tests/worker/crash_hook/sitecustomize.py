"""Fault-test hooks, imported at start by a worker whose PYTHONPATH begins with this folder:

- ``WEIR_TEST_CRASH_MARKER``: the worker process SIGKILLs itself when it starts a job whose
  prompt contains the marker (a job that crashes the worker every time).
- ``WEIR_TEST_RUN_LOG``: a file; every engine run of a job (each ``WorkerRuntime.begin_run``, on
  the per-job and the chunk path) appends one line ``<job id>`` to it, so a test counts engine
  runs per job, an effect, not rows.
- ``WEIR_TEST_RUN_SLEEP_S``: every engine run waits this long first (a slow job, whatever the
  engine's speed).
- ``WEIR_TEST_STEP_FAILURES``: the first N engine steps of this process raise (``always``: every
  step), as a device error would.
- ``WEIR_TEST_ATTEMPT_ERRORS``: N; the first N deliveries this process takes (``run_job`` and
  ``run_chunk`` alike) raise an unexpected error before they claim anything.
- ``WEIR_TEST_KILL_ON_FETCH``: N; the worker process SIGKILLs itself when kombu's Redis transport
  is about to record the N-th message it took (BRPOP) as unacked: the message is then in no
  Redis list and in no unacked record, the window only the sweeper recovers from.
"""

import os

_marker = os.environ.get("WEIR_TEST_CRASH_MARKER")
_run_log = os.environ.get("WEIR_TEST_RUN_LOG")
_step_failures = os.environ.get("WEIR_TEST_STEP_FAILURES")
_run_sleep_s = float(os.environ.get("WEIR_TEST_RUN_SLEEP_S") or 0)

if _marker or _run_log or _run_sleep_s:
    import signal

    from weir.worker import runtime as _runtime

    _run = _runtime.WorkerRuntime.begin_run

    def _hooked_run(self, job, **kwargs):
        if _run_log:
            with open(_run_log, "a") as f:  # one short line per O_APPEND write: no interleaving
                f.write(f"{job.id}\n")
        if _marker and _marker in str(job.request.get("prompt")):
            os.kill(os.getpid(), signal.SIGKILL)
        if _run_sleep_s:
            import time

            time.sleep(_run_sleep_s)
        return _run(self, job, **kwargs)

    _runtime.WorkerRuntime.begin_run = _hooked_run

if _step_failures:
    from weir.engine import llm_engine as _llm_engine

    _step = _llm_engine.LLMEngine.step
    _left = [None if _step_failures == "always" else int(_step_failures)]

    def _failing_step(self):
        if _left[0] is None or _left[0] > 0:
            if _left[0] is not None:
                _left[0] -= 1
            raise RuntimeError("injected device error (WEIR_TEST_STEP_FAILURES)")
        return _step(self)

    _llm_engine.LLMEngine.step = _failing_step

_kill_on_fetch = os.environ.get("WEIR_TEST_KILL_ON_FETCH")

if _kill_on_fetch:
    import signal

    from kombu.transport import redis as _kombu_redis

    _append = _kombu_redis.QoS.append
    _fetched = [0]

    def _append_or_die(self, message, delivery_tag):
        _fetched[0] += 1
        if _fetched[0] >= int(_kill_on_fetch):
            os.kill(os.getpid(), signal.SIGKILL)
        return _append(self, message, delivery_tag)

    _kombu_redis.QoS.append = _append_or_die

_attempt_errors = os.environ.get("WEIR_TEST_ATTEMPT_ERRORS")

if _attempt_errors:
    import threading

    from weir.worker import attempt as _attempt, chunk as _chunk

    _left_errors = [int(_attempt_errors)]
    _errors_lock = threading.Lock()

    def _raising(run):
        def attempt_or_raise(*args, **kwargs):
            with _errors_lock:
                fail = _left_errors[0] > 0
                _left_errors[0] -= fail
            if fail:
                raise RuntimeError("injected unexpected error (WEIR_TEST_ATTEMPT_ERRORS)")
            return run(*args, **kwargs)

        return attempt_or_raise

    _attempt.run_attempt = _raising(_attempt.run_attempt)
    _chunk.run_chunk_attempt = _raising(_chunk.run_chunk_attempt)
