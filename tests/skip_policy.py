"""Which tests a CI run may skip, and the check that holds a CI run to it.

A green CI run must mean the integration, data and kernel tests ran. Under ``CI`` (``.ci/run`` sets
it) :class:`SkipPolicy` turns the run red when a test is skipped for a reason that is not in
:data:`ALLOWED_CI_SKIPS` (a missing Redis, Postgres, catalog, model package or Triton shows up as
such a reason), and, on a run of the whole suite, when an allowed reason was not skipped at all (a
stale entry hides nothing today but would hide the next skip of that kind). ``tests/conftest.py``
registers it; ``tests/test_skip_policy.py`` runs it on small suites of its own.
"""

from __future__ import annotations

import ast
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


# reason (exact) -> why the GPU machine (bench/gpu.sh) may skip it. bench.junit_check --gpu-skip-policy
# fails a GPU test step on any other skip; tests/bench/test_skip_reasons.py finds, on CPU, every
# reason a test of those steps skips for when CUDA is there and requires it to be listed here.
ALLOWED_GPU_SKIPS: dict[str, str] = {
    "CPU-interpreter run of the kernel path": "the kernel path under TRITON_INTERPRET, CPU only",
    "counts the CPU-interpreter run": "counts kernel launches of the interpreter, CPU only",
    "CPU tensors under the Triton interpreter": "the Triton backend on CPU tensors, CPU only",
    "the CPU attention kernel could not be built": "a C compiler the image may lack; a CPU kernel",
}


def cuda_skip_reasons(source: str) -> list[tuple[int, str]]:
    """``(line, reason)`` of every skip in a test file's source that fires when CUDA is available.

    Read without importing the file: each ``pytest.mark.skipif(condition, reason=...)`` whose
    condition mentions ``cuda.is_available()`` is evaluated with CUDA present (a condition naming
    anything else counts as firing), and each ``pytest.skip(...)`` / ``pytest.importorskip(...)``
    lying under an ``if`` whose test is true with CUDA present counts too. A reason that is not a
    string literal is given as the text of its expression, so it can match no allowed reason.
    """
    found: list[tuple[int, str]] = []

    def reason_of(node: ast.Call, position: int) -> str | None:
        for kw in node.keywords:
            if kw.arg == "reason":
                return _literal(kw.value)
        return _literal(node.args[position]) if len(node.args) > position else None

    def visit(node: ast.AST, under_cuda: bool) -> None:
        if isinstance(node, ast.If):
            fires = _fires_with_cuda(node.test)
            for child in node.body:
                visit(child, under_cuda or fires is True)
            for child in node.orelse:
                visit(child, under_cuda or fires is False)
            return
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == "pytest.mark.skipif" and node.args and _fires_with_cuda(node.args[0]) is not False:
                if "cuda.is_available" in ast.unparse(node.args[0]):
                    found.append((node.lineno, reason_of(node, 1) or ""))
            elif name in ("pytest.skip", "pytest.importorskip") and under_cuda:
                found.append((node.lineno, reason_of(node, 0 if name == "pytest.skip" else 2) or ""))
        for child in ast.iter_child_nodes(node):
            visit(child, under_cuda)

    visit(ast.parse(source), False)
    return sorted(found)


def _literal(node: ast.AST) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)


def _fires_with_cuda(test: ast.AST) -> bool | None:
    """The value of a condition with ``torch.cuda.is_available()`` true; None when it names anything
    else or does not mention CUDA at all."""
    text = ast.unparse(test)
    if "cuda.is_available()" not in text:
        return None
    try:
        value = eval(compile(ast.Expression(test), "<skip condition>", "eval"), {"__builtins__": {}},
                     {"torch": _CudaPresent()})
    except Exception:  # noqa: BLE001 - a condition on anything else may fire: count it
        return True
    return bool(value)


class _CudaPresent:
    """``torch`` as far as a skip condition reads it, on a machine with CUDA."""

    class cuda:  # noqa: N801 - stands for torch.cuda
        @staticmethod
        def is_available() -> bool:
            return True


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
