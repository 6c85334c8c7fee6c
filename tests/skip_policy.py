"""Which tests a CI run may skip, and the check that holds a CI run to it.

A green CI run must mean the integration, data and kernel tests ran. Under ``CI`` (``.ci/run`` sets
it) :class:`SkipPolicy` turns the run red when a test is skipped for a reason that is not in
:data:`ALLOWED_CI_SKIPS` (a missing Redis, Postgres, catalog, model package or Triton shows up as
such a reason), and, on a run of the whole suite, when an allowed reason was not skipped at all (a
stale entry hides nothing today but would hide the next skip of that kind). ``tests/conftest.py``
registers it; ``tests/test_skip_policy.py`` runs it on small suites of its own.
"""

from __future__ import annotations

import os
from typing import Mapping

import pytest

# reason (exact, as pytest reports it) -> why CI's CPU machine may skip it. Each is a test that needs
# CUDA; the GPU plan runs them (bench/gpu.sh).
ALLOWED_CI_SKIPS: dict[str, str] = {
    "the Triton backend on CUDA (on CPU: tests/kernels)": "needs CUDA",
    "captures CUDA graphs": "needs CUDA",
    "needs CUDA: the cache is sized from torch.cuda.mem_get_info": "needs CUDA",
}


def skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skipped test's report, without pytest's ``"Skipped: "`` prefix."""
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


def problems(skipped: Mapping[str, str], allowed: Mapping[str, str], whole_suite: bool) -> list[str]:
    """Why a CI run's skips are not the allowed ones, one line each; empty when they are.

    ``skipped`` maps each skipped test id to its reason. A reason outside ``allowed`` is a problem;
    with ``whole_suite``, so is an allowed reason that no test was skipped for.
    """
    found = [f"skipped for a reason CI does not allow ({reason}): {test_id}"
             for test_id, reason in sorted(skipped.items()) if reason not in allowed]
    if whole_suite:
        seen = set(skipped.values())
        found += [f"allowed skip reason that no test had (remove it from ALLOWED_CI_SKIPS): {reason}"
                  for reason in allowed if reason not in seen]
    return found


class SkipPolicy:
    """A pytest plugin: under ``CI``, a run whose skips break :func:`problems` exits with status 1
    and prints each problem at the end."""

    def __init__(self, allowed: Mapping[str, str]):
        self.allowed = dict(allowed)
        self.skipped: dict[str, str] = {}
        self.found: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped[report.nodeid] = skip_reason(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not os.environ.get("CI") or exitstatus == pytest.ExitCode.INTERRUPTED:
            return
        self.found = problems(self.skipped, self.allowed, _is_whole_suite(session))
        if self.found and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.found:
            terminalreporter.write_line(f"skip policy: {line}", red=True)


def _is_whole_suite(session: pytest.Session) -> bool:
    """Whether the run collected the whole suite: no test paths, ``-k``, ``-m`` or deselection."""
    config = session.config
    option = config.option
    narrowed = (option.keyword or option.markexpr or getattr(option, "deselect", None)
                or getattr(option, "lf", False))
    from_testpaths = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return from_testpaths and not narrowed and not session.shouldfail and not session.shouldstop
