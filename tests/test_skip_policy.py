"""The CI skip policy (``tests/skip_policy.py``) on small suites of its own, run as pytest runs CI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.skip_policy import ALLOWED_CI_SKIPS, problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu():
    pass

def test_service():
    pytest.skip("no Redis at redis://127.0.0.1:6379/0")

@pytest.mark.xfail(reason="known", strict=True)
def test_known():
    assert False
'''


def run_suite(tmp_path, allowed: dict, ci: bool, *args: str) -> subprocess.CompletedProcess:
    """Run ``SUITE`` in ``tmp_path`` under a :class:`SkipPolicy` with ``allowed``, with or without ``CI``."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_suite.py").write_text(SUITE)
    (tmp_path / "tests" / "conftest.py").write_text(textwrap.dedent(f'''
        from tests_policy import SkipPolicy

        def pytest_configure(config):
            config.pluginmanager.register(SkipPolicy({allowed!r}), "weir-skip-policy")
    '''))
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tmp_path / "tests_policy.py").write_text(open(os.path.join(ROOT, "tests", "skip_policy.py")).read())
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(tmp_path)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_ci_fails_a_skip_outside_the_allow_list(tmp_path):
    result = run_suite(tmp_path, {"needs a GPU": "no GPU in CI"}, ci=True)
    assert result.returncode == 1, result.stdout
    assert ("skip policy: skipped for a reason CI does not allow (no Redis at redis://127.0.0.1:6379/0): "
            "tests/test_suite.py::test_service") in result.stdout
    assert "needs a GPU" not in result.stdout.split("skip policy:", 1)[1]


def test_without_ci_a_skip_is_a_skip(tmp_path):
    result = run_suite(tmp_path, {"needs a GPU": "no GPU in CI"}, ci=False)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in result.stdout
    assert "skip policy" not in result.stdout


def test_ci_passes_when_the_skips_are_the_allowed_ones(tmp_path):
    allowed = {"needs a GPU": "no GPU in CI", "no Redis at redis://127.0.0.1:6379/0": "test"}
    result = run_suite(tmp_path, allowed, ci=True)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in result.stdout


def test_ci_fails_an_allowed_reason_no_test_had_on_the_whole_suite_only(tmp_path):
    allowed = {"needs a GPU": "", "no Redis at redis://127.0.0.1:6379/0": "", "captures CUDA graphs": ""}
    whole = run_suite(tmp_path, allowed, ci=True)
    assert whole.returncode == 1, whole.stdout
    assert ("skip policy: allowed skip reason that no test had (remove it from ALLOWED_CI_SKIPS): "
            "captures CUDA graphs") in whole.stdout
    part = run_suite(tmp_path, allowed, True, "-k", "gpu or service")
    assert part.returncode == 0, part.stdout


def test_problems_names_each_unexpected_skip_and_stale_reason():
    skipped = {"a::x": "needs CUDA", "b::y": "no Postgres at postgresql://x"}
    assert problems(skipped, {"needs CUDA": "", "gone": ""}, whole_suite=True) == [
        "skipped for a reason CI does not allow (no Postgres at postgresql://x): b::y",
        "allowed skip reason that no test had (remove it from ALLOWED_CI_SKIPS): gone",
    ]
    assert problems(skipped, {"needs CUDA": "", "gone": ""}, whole_suite=False) == [
        "skipped for a reason CI does not allow (no Postgres at postgresql://x): b::y",
    ]


def test_every_allowed_reason_is_written_in_a_test_file():
    """Each allowed reason is the literal reason of some test under tests/ (no entry for a test
    that no longer exists)."""
    sources = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        sources += [open(os.path.join(folder, f)).read() for f in files
                    if f.endswith(".py") and f != "skip_policy.py"]
    text = "\n".join(sources)
    for reason in ALLOWED_CI_SKIPS:
        assert f'reason="{reason}"' in text, reason
