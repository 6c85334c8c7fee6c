"""Where the engine core's intra-op threads and the job side's threads run."""

import os

import pytest

from weir.worker.placement import Placement, parse_cpu_list, plan


@pytest.fixture(autouse=True)
def no_omp_cap(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_a_cpu_list_reads_ids_and_ranges():
    assert parse_cpu_list("0-3,8, 6") == (0, 1, 2, 3, 6, 8)
    for bad, why in (("a", "is not a CPU list"), ("3-1", "is empty"), (",", "names no CPU"), ("1-", "not a CPU list")):
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


def test_auto_binds_nothing_on_two_cpus_and_reserves_one_for_the_job_side_above():
    assert plan("auto", None, available=(0, 1)) == Placement(None, None, 2)
    assert plan("auto", None, available=(0, 1, 2, 3)) == Placement((1, 2, 3), (0,), 3)
    assert plan("auto", 2, available=(4, 5, 6, 7)) == Placement((6, 7), (4, 5), 2)
    assert plan("auto", 1, available=(0, 1)) == Placement((1,), (0,), 1)
    with pytest.raises(ValueError, match="WEIR_CPU_NUM_OF_RESERVED_CPU=2 leaves the engine core no CPU"):
        plan("auto", 2, available=(0, 1))


def test_a_cpu_list_gives_the_engine_those_and_the_job_side_the_rest():
    assert plan("1-3", None, available=(0, 1, 2, 3)) == Placement((1, 2, 3), (0,), 3)
    assert plan("0-1", None, available=(0, 1)) == Placement((0, 1), None, 2)
    with pytest.raises(ValueError, match="names CPUs this process may not use: 7"):
        plan("0,7", None, available=(0, 1))


def test_nobind_and_omp_num_threads(monkeypatch):
    assert plan("nobind", 1, available=(0, 1, 2, 3)) == Placement(None, None, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan("auto", None, available=(0, 1, 2, 3)) == Placement((1, 2, 3), (0,), 1)


def test_the_setting_refuses_a_bad_cpu_list():
    from pydantic import ValidationError

    from weir.config import WorkerSettings

    assert WorkerSettings(cpu_omp_threads_bind=" 0-1 ").cpu_omp_threads_bind == "0-1"
    with pytest.raises(ValidationError, match="'x1' is not a CPU list"):
        WorkerSettings(cpu_omp_threads_bind="x1")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity needs Linux")
def test_the_engine_core_process_runs_on_its_cpus_with_its_threads(tmp_path):
    from weir.engine.core_client import EngineCoreClient
    from weir.jobs.testing import save_tiny_chat_model

    cpu = sorted(os.sched_getaffinity(0))[-1]
    client = EngineCoreClient(dict(model=save_tiny_chat_model(str(tmp_path / "m")), device="cpu",
                                   cpu_kv_cache_bytes=8 << 20), num_threads=1, cpu_affinity=[cpu])
    try:
        assert os.sched_getaffinity(client.process.pid) == {cpu}
    finally:
        client.shutdown()


def test_the_openmp_spin_is_limited_unless_the_environment_chooses():
    from weir.engine.openmp import limit_omp_spinning

    environ = {}
    assert limit_omp_spinning(environ) == "3000" and environ == {"GOMP_SPINCOUNT": "3000"}
    environ = {"GOMP_SPINCOUNT": "500"}
    assert limit_omp_spinning(environ) == "500" and environ == {"GOMP_SPINCOUNT": "500"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert limit_omp_spinning(environ) is None and environ == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_offline_engine_gets_the_short_spin_before_torch_loads():
    import subprocess
    import sys

    code = ("import os, sys; from weir import LLM; LLM; "
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3000", "True"]
