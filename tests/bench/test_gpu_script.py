"""bench/gpu.sh cannot rot unseen: its dry run names every step with a command whose module accepts
its options and whose test selection collects tests, inside the GPU machine's time limits; the
engine and the GPU steps import nothing the GPU machine lacks; JUnit verdicts fail skipped runs."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from bench import junit_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST = ["kernel_tests", "engine_cuda_tests", "dummy_check", "mixed", "mixed_eager"]
SECOND = ["greedy_check", "wgen"]
STEPS = FIRST + SECOND
COMMAND_LIMIT_S = 600  # one command on the GPU machine
START_S = 120  # a fresh machine's start and the transfers, counted in the device time


def dry_run(*args: str, expected: dict | None = None) -> tuple[list[str], dict[str, tuple[int, list[str]]]]:
    """The SETUP lines and, per step, its time limit and command words; ``expected``, when given,
    is filled with each step's expected seconds."""
    out = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", *args], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHON": sys.executable}).stdout
    setup = [line[len("SETUP "):] for line in out.splitlines() if line.startswith("SETUP ")]
    steps = {}
    for line in out.splitlines():
        m = re.match(r"STEP (\S+) (\d+)s expect=(\d+)s model=[01]: (.*)$", line)
        if m:
            steps[m[1]] = (int(m[2]), shlex.split(m[4]))
            if expected is not None:
                expected[m[1]] = int(m[3])
    return setup, steps


class _Parsed(Exception):
    pass


def parse_only(monkeypatch, module: str, argv: list[str]) -> argparse.Namespace:
    """Run ``module.main(argv)`` up to its argument parsing (an unknown option or a bad value
    exits 2 there), and return the parsed options without running the step."""
    parse_args = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(module).main(argv)
    return parsed.value.args[0]


@pytest.mark.parametrize("small", [False, True], ids=["gpu", "small"])
def test_every_step_runs_a_command_its_module_accepts(monkeypatch, small):
    _, steps = dry_run(*(["--small"] if small else []))
    assert [s for s in steps if not s.endswith("_junit")] == STEPS
    for name, (_, words) in steps.items():
        assert words[0] == sys.executable and words[1] == "-m", name
        if words[2] == "pytest":
            continue
        options = parse_only(monkeypatch, words[2], words[3:])
        if words[2] == "bench.junit_check":
            assert options.min_passed >= 1
        else:
            assert options.device == ("cpu" if small else "cuda"), name


SETUP_S = 30  # wheels into the site folder, weir installed editable (and, second call, the model wheel)


def test_the_two_calls_fit_with_margin():
    """First call: expected at most 7 minutes with the machine's start; second call (sent at once,
    on the warm machine: no start) at most 3 minutes with its transfers; each call's limits inside
    one command; every limit leaves its step room (at least 1.5 times what it is expected to take)."""
    expected = {}
    _, steps = dry_run(expected=expected)
    limit = {name: s for name, (s, _) in steps.items()}
    for group, expected_s in ((FIRST, 7 * 60 - START_S), (SECOND, 3 * 60 - 30)):
        names = [n for n in steps if n in group or n.removesuffix("_junit") in group]
        assert SETUP_S + sum(expected[n] for n in names) <= expected_s, group
        assert SETUP_S + sum(limit[n] for n in names) <= COMMAND_LIMIT_S - 30, group
    assert all(limit[n] >= 1.5 * expected[n] for n in steps), {n: (limit[n], expected[n]) for n in steps}
    _, small = dry_run("--small")
    assert all(s <= COMMAND_LIMIT_S for s, _ in small.values())


def test_the_groups_name_the_calls():
    for group, names in (("first", FIRST), ("second", SECOND)):
        _, steps = dry_run(group)
        assert [s for s in steps if not s.endswith("_junit")] == names


def test_every_step_runs_unbuffered_and_keeps_its_output():
    text = open(os.path.join(ROOT, "bench", "gpu.sh")).read()
    assert "export PYTHONUNBUFFERED=1" in text
    assert re.search(r'timeout -k \d+ "\$limit" "\$@" >"\$RAW/\$name.log" 2>&1', text)


@pytest.mark.parametrize("small", [False, True], ids=["gpu", "small"])
def test_each_test_selection_collects_at_least_what_its_verdict_asks(small):
    _, steps = dry_run(*(["--small"] if small else []))
    for name in ("kernel_tests", "engine_cuda_tests"):
        words = [w for w in steps[name][1] if not w.startswith("--junitxml")]
        # collected where the worker's packages cannot be imported, as on the GPU machine
        out = subprocess.run([*words, "--collect-only", "-p", "no:cacheprovider"], cwd=ROOT,
                             capture_output=True, text=True, env=lacking_env())
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        collected = sum("::" in line for line in out.stdout.splitlines())  # one node id a line
        min_passed = int(steps[f"{name}_junit"][1][steps[f"{name}_junit"][1].index("--min-passed") + 1])
        assert collected >= min_passed, (name, collected, min_passed)


def test_an_unknown_step_is_refused():
    out = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", "kernels"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument kernels" in out.stderr


def lacking_env() -> dict:
    """The environment in which the packages gpu.sh --small refuses cannot be imported."""
    setup, _ = dry_run("--small")
    lacks = re.search(r"DEVICE_LACKS='([^']*)'", " ".join(setup))[1]
    return {**os.environ, "PYTHONPATH": os.path.join(ROOT, "bench", "device_site"), "DEVICE_LACKS": lacks}


def lacking_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a Python where the packages gpu.sh --small refuses cannot be imported."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=lacking_env())


def test_the_engine_and_the_gpu_steps_import_nothing_the_gpu_machine_lacks():
    out = lacking_python(
        "import weir.engine.llm, weir.engine.gpu_memory, weir.engine.cuda_graphs, weir.engine.attention\n"
        "import bench.greedy_check, bench.mixed, bench.run, bench.junit_check\n"
        "from weir.model_source import resolve_model\n"
        "print(resolve_model(None).gguf_file)\n")
    assert out.returncode == 0 and "refused import" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.strip() == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_lacking_packages_are_really_refused():
    out = lacking_python("import weir.config")  # the settings need pydantic-settings
    assert out.returncode == 1 and "refused import of 'pydantic'" in out.stderr


def write_junit(tmp_path, cases: str) -> str:
    path = tmp_path / "results.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return str(path)


def test_junit_verdict_fails_failures_unexpected_skips_and_too_few_passes(tmp_path):
    ok = '<testcase classname="tests.kernels.test_a" name="test_x[dtype1]"/>'
    cpu_only = ('<testcase classname="tests.kernels.test_b" name="test_y"><skipped message="CPU-interpreter '
                'run of the kernel path"/></testcase>')
    no_triton = ('<testcase classname="tests.kernels.test_c" name="test_z"><skipped message="weir.kernels.kv_cache '
                 'needs Triton"/></testcase>')
    failed = '<testcase classname="tests.kernels.test_a" name="test_w"><failure message="assert 1 == 2"/></testcase>'
    allow = ["--allow-skip", "CPU-interpreter run"]
    assert junit_check.main([write_junit(tmp_path, ok + cpu_only), *allow]) == 0
    assert junit_check.main([write_junit(tmp_path, ok + cpu_only)]) == 1  # a skip nobody expected
    assert junit_check.main([write_junit(tmp_path, ok + no_triton), *allow]) == 1
    assert junit_check.main([write_junit(tmp_path, ok + failed), *allow]) == 1
    assert junit_check.main([write_junit(tmp_path, ok), "--min-passed", "2"]) == 1
