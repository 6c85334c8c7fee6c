"""The GPU steps' skip allow-list, checked on CPU: every reason a test of bench/gpu.sh's test steps
skips for when CUDA is there is in tests.skip_policy.ALLOWED_GPU_SKIPS, and the JUnit verdict of
those steps allows exactly that list."""

from __future__ import annotations

import glob
import os

import pytest

from bench import junit_check
from tests.bench.test_gpu_script import ROOT, dry_run, write_junit
from tests.skip_policy import ALLOWED_GPU_SKIPS, cuda_skip_reasons

TEST_STEPS = ("kernel_tests", "engine_cuda_tests")


def gpu_test_files() -> list[str]:
    """The test files the GPU run's test steps collect (folders expanded), and the helper modules
    of tests/ beside them (a skip in a helper fires in the tests that call it)."""
    _, steps = dry_run()
    files = []
    for name in TEST_STEPS:
        for word in steps[name][1]:
            path = os.path.join(ROOT, word)
            if word.startswith("tests/") and os.path.isdir(path):
                files += sorted(glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
            elif word.startswith("tests/") and word.endswith(".py"):
                files.append(path)
    folders = {os.path.dirname(f) for f in files}
    files += [f for folder in folders for f in glob.glob(os.path.join(folder, "*.py"))
              if not os.path.basename(f).startswith("test_")]
    return sorted(set(files))


def test_the_gpu_steps_collect_the_engine_and_kernel_tests():
    names = {os.path.relpath(f, ROOT) for f in gpu_test_files()}
    assert {"tests/engine/test_piecewise_graphs.py", "tests/kernels/test_engine_kernels.py",
            "tests/kernels/support.py"} <= names


def test_every_cuda_skip_reason_of_the_gpu_steps_is_allowed():
    found = {}
    for path in gpu_test_files():
        with open(path) as f:
            for line, reason in cuda_skip_reasons(f.read()):
                found[f"{os.path.relpath(path, ROOT)}:{line}"] = reason
    assert found, "no CUDA skip found: the reader finds nothing"
    assert {where: reason for where, reason in found.items() if reason not in ALLOWED_GPU_SKIPS} == {}


def test_every_allowed_gpu_reason_is_written_in_a_gpu_test_file():
    text = "\n".join(open(p).read() for p in gpu_test_files())
    for reason in ALLOWED_GPU_SKIPS:
        assert f'"{reason}"' in text, reason


SOURCE = '''
import pytest, torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="module on CPU only")

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a():
    pass

@pytest.mark.skipif(torch.cuda.is_available() and FLAG, reason="cuda and a flag")
def test_b():
    if torch.cuda.is_available():
        pytest.skip("not on CUDA")
    else:
        pytest.skip("not on CPU")
    if name == "cpu":
        pytest.skip("a runtime reason")
    pytest.importorskip("triton", reason=REASON)
'''


def test_the_reader_finds_the_reasons_that_fire_with_cuda():
    assert cuda_skip_reasons(SOURCE) == [(4, "module on CPU only"), (10, "cuda and a flag"),
                                        (13, "not on CUDA")]
    assert cuda_skip_reasons(SOURCE.replace("if torch.cuda.is_available():", "if not torch.cuda.is_available():")) == [
        (4, "module on CPU only"), (10, "cuda and a flag"), (15, "not on CPU")]


@pytest.mark.parametrize("step", TEST_STEPS)
def test_the_gpu_verdict_allows_the_listed_reasons_and_no_other(tmp_path, step):
    _, steps = dry_run()
    words = steps[f"{step}_junit"][1]
    options = words[words.index("bench.junit_check") + 2:]
    ok = '<testcase classname="tests.engine.test_a" name="test_x"/>'
    cases = "".join(f'<testcase classname="tests.t" name="s{i}"><skipped message="{reason}"/></testcase>'
                    for i, reason in enumerate(ALLOWED_GPU_SKIPS))
    other = '<testcase classname="tests.t" name="z"><skipped message="needs Triton"/></testcase>'
    assert junit_check.main([write_junit(tmp_path, ok + cases), *options, "--min-passed", "1"]) == 0
    assert junit_check.main([write_junit(tmp_path, ok + cases + other), *options, "--min-passed", "1"]) == 1
