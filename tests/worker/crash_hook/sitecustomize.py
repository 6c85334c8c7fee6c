"""Fault-test hook, imported at start by a worker whose PYTHONPATH begins with this folder: with
``WEIR_TEST_CRASH_MARKER`` set, the worker process SIGKILLs itself when it starts a job whose
prompt contains the marker (a job that crashes the worker every time)."""

import os

_marker = os.environ.get("WEIR_TEST_CRASH_MARKER")
if _marker:
    import signal

    from worker import runtime as _runtime

    _run = _runtime.WorkerRuntime.run

    def _run_or_crash(self, job, **kwargs):
        if _marker in str(job.request.get("prompt")):
            os.kill(os.getpid(), signal.SIGKILL)
        return _run(self, job, **kwargs)

    _runtime.WorkerRuntime.run = _run_or_crash
