"""compose.yaml's restart policies, healthchecks and start order, and the ``weir health`` commands
its healthchecks run, against a real ``weir worker`` and a real ``celery beat`` on real Redis."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from tests.worker.conftest import REPO_ROOT
from weir import health
from weir.cli import build_parser, cmd_health
from weir.config import WorkerSettings
from weir.worker.testing import WorkerProcess

LONG_RUNNING = {"redis", "postgres", "worker", "worker-gpu1", "beat"}
ONE_SHOT = {"migrate"}
# A Redis database of the test server that no other test's worker uses, so that "any weir worker
# on this host" sees only the workers these tests start.
PRIVATE_REDIS_DB = 13


@pytest.fixture(scope="module")
def compose():
    with open(os.path.join(REPO_ROOT, "compose.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _duration_s(text: str) -> float:
    """A compose duration ("5m", "1m30s", "90s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and any(parts.groups()), f"not a compose duration: {text!r}"
    hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    return 3600 * hours + 60 * minutes + seconds


def test_every_service_is_either_long_running_or_one_shot(compose):
    assert set(compose["services"]) == LONG_RUNNING | ONE_SHOT


@pytest.mark.parametrize("name", sorted(LONG_RUNNING))
def test_long_running_services_restart_and_have_a_healthcheck(compose, name):
    service = compose["services"][name]
    assert service["restart"] == "unless-stopped"
    check = service["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1
    assert {"interval", "timeout", "retries"} <= set(check)


def test_migrate_runs_once(compose):
    migrate = compose["services"]["migrate"]
    assert migrate["restart"] == "no"
    assert "healthcheck" not in migrate


def test_healthcheck_commands(compose):
    services = compose["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]
    assert services["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "weir", "health", "worker"]
    assert services["beat"]["healthcheck"]["test"] == ["CMD", "weir", "health", "beat"]
    # the beat healthcheck pings beat, which answers only with remote control on
    assert "--enable-remote-control" in services["beat"]["entrypoint"]
    for name in ("worker", "beat"):
        args = build_parser().parse_args(services[name]["healthcheck"]["test"][2:])
        assert (args.func, args.process) == (cmd_health, name)


def test_depends_on_waits_for_health_or_completion(compose):
    services = compose["services"]
    expected = {
        "migrate": {"postgres": "service_healthy"},
        "worker": {"redis": "service_healthy", "postgres": "service_healthy",
                   "migrate": "service_completed_successfully"},
        "beat": {"redis": "service_healthy"},
    }
    expected["worker-gpu1"] = expected["worker"]
    expected = {
        **expected,
    }
    found = {name: {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
             for name, service in services.items() if "depends_on" in service}
    assert found == expected


def test_one_worker_per_gpu_each_pinned_to_its_own_device(compose):
    """``worker`` takes device 0 and ``worker-gpu1`` (profile ``gpu1``) device 1: the same
    service otherwise, each with its own host port for its metrics."""
    workers = {name: compose["services"][name] for name in ("worker", "worker-gpu1")}
    devices = {name: w["deploy"]["resources"]["reservations"]["devices"] for name, w in workers.items()}
    assert {name: [d["device_ids"] for d in ds] for name, ds in devices.items()} == {
        "worker": [["0"]], "worker-gpu1": [["1"]]}
    assert all("count" not in d for ds in devices.values() for d in ds)  # pinned, not "any one GPU"
    assert "profiles" not in workers["worker"] and workers["worker-gpu1"]["profiles"] == ["gpu1"]
    strip = {"deploy", "ports", "profiles"}
    assert ({k: v for k, v in workers["worker"].items() if k not in strip}
            == {k: v for k, v in workers["worker-gpu1"].items() if k not in strip})
    host_ports = [spec.split(":")[0] for w in workers.values() for spec in w["ports"]]
    assert len(set(host_ports)) == 2


def test_worker_publishes_its_metrics_port(compose):
    worker = compose["services"]["worker"]
    port = int(worker["environment"]["WEIR_METRICS_PORT"])
    published = [spec.rsplit(":", 1)[1] for spec in worker["ports"]]
    assert WorkerSettings(metrics_port=port).metrics_port == port  # a valid setting, not "off"
    assert port > 0 and published == [str(port)]
    for name in ("migrate", "beat"):  # only the worker serves metrics
        assert "WEIR_METRICS_PORT" not in compose["services"][name]["environment"]


def test_worker_grace_period_outlasts_the_shutdown_timeout(compose):
    worker = compose["services"]["worker"]
    shutdown_timeout_s = float(worker["environment"].get(
        "WEIR_SHUTDOWN_TIMEOUT_S", WorkerSettings.model_fields["shutdown_timeout_s"].default))
    assert worker["stop_signal"] == "SIGTERM"
    assert _duration_s(worker["stop_grace_period"]) > shutdown_timeout_s


# ---- `weir health` against real processes -----------------------------------------------------


def weir_health(*args, broker_url, queue=None, timeout_s=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if broker_url is not None:
        env["WEIR_BROKER_URL"] = broker_url
    if queue is not None:
        env["WEIR_QUEUE"] = queue
    return subprocess.run([sys.executable, "-m", "weir", "health", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def assert_unhealthy(done, *phrases):
    """Exit status 1, nothing on stdout, one line on stderr holding every phrase."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for phrase in phrases:
        assert phrase in lines[0]


def delete_keys(url: str, queue: str) -> None:
    client = redis.Redis.from_url(url)
    keys = [queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    client.delete(*(keys + list(client.scan_iter(f"{queue}*"))))


@pytest.fixture
def private_broker_url(redis_url, queue):
    """``redis_url`` on :data:`PRIVATE_REDIS_DB`; the test queue's keys there go afterwards."""
    url = urlsplit(redis_url)._replace(path=f"/{PRIVATE_REDIS_DB}").geturl()
    yield url
    delete_keys(url, queue)


@pytest.mark.integration
def test_health_worker_passes_while_the_worker_runs(start_worker, private_broker_url, queue):
    worker = start_worker(WEIR_BROKER_URL=private_broker_url)

    any_on_host = weir_health("worker", broker_url=private_broker_url, queue=queue)
    exact = weir_health("worker", "--hostname", worker.hostname, broker_url=private_broker_url, queue=queue)

    assert any_on_host.returncode == 0, any_on_host.stderr
    assert any_on_host.stdout == f"weir health worker: {worker.hostname} consumes {queue} on {private_broker_url}\n"
    assert exact.returncode == 0, exact.stderr
    assert exact.stdout == any_on_host.stdout
    assert worker.terminate() == 0
    gone = weir_health("worker", "--timeout-s", "2", broker_url=private_broker_url, queue=queue)
    assert_unhealthy(gone, f"no answer from weir-*@{os.uname().nodename}", "within 2s")


@pytest.mark.integration
def test_health_worker_fails_when_the_workers_of_this_host_consume_another_queue(
        start_worker, private_broker_url, queue):
    worker = start_worker(WEIR_BROKER_URL=private_broker_url)
    other = queue + "-other"

    for args in ((), ("--hostname", worker.hostname)):
        done = weir_health("worker", *args, "--timeout-s", "2", broker_url=private_broker_url, queue=other)
        assert_unhealthy(done)
        host = args[1] if args else f"weir-*@{os.uname().nodename}"
        assert done.stderr == (f"weir health worker: no worker of {host} on {private_broker_url} consumes {other} "
                               f"({worker.hostname} consumes {queue}, {queue}.control)\n")
    # the model's queue when WEIR_QUEUE is not set: weir.<model name>, the packaged SmolLM2's here
    default = weir_health("worker", "--timeout-s", "2", broker_url=private_broker_url)
    assert_unhealthy(default, "consumes weir.SmolLM2-135M-Instruct (")


@pytest.mark.integration
def test_health_worker_finds_the_worker_of_its_queue_among_several(start_worker, private_broker_url, queue):
    """Two workers on this host, each on its own queue: whichever answers first, the check for
    either queue finds its worker (the second round asks only the workers not yet heard)."""
    other = queue + "-other"
    try:
        workers = {q: start_worker(WEIR_BROKER_URL=private_broker_url, WEIR_QUEUE=q) for q in (queue, other)}
        for q, worker in workers.items():
            done = weir_health("worker", broker_url=private_broker_url, queue=q)
            assert done.returncode == 0, done.stderr
            assert done.stdout == f"weir health worker: {worker.hostname} consumes {q} on {private_broker_url}\n"
    finally:
        delete_keys(private_broker_url, other)


def test_the_pattern_of_unheard_workers_excludes_those_heard(monkeypatch):
    monkeypatch.setattr(health, "nodename", lambda: "gpu.host-1")
    names = ["weir-12@gpu.host-1", "weir-13@gpu.host-1", "weir-1@gpu.host-1", "weir-12@gpu.host-10",
             "celerybeat@gpu.host-1", "weir-12@gpuxhost-1"]

    def matching(heard):
        return [n for n in names if re.match(health._unheard_workers(dict.fromkeys(heard, [])), n)]

    assert matching([]) == ["weir-12@gpu.host-1", "weir-13@gpu.host-1", "weir-1@gpu.host-1"]
    assert matching(["weir-12@gpu.host-1"]) == ["weir-13@gpu.host-1", "weir-1@gpu.host-1"]
    assert matching(["weir-12@gpu.host-1", "weir-1@gpu.host-1"]) == ["weir-13@gpu.host-1"]


@pytest.mark.integration
def test_health_worker_fails_without_a_worker(private_broker_url, redis_url):
    assert_unhealthy(weir_health("worker", "--timeout-s", "1", broker_url=private_broker_url),
                     "no answer from weir-*@")
    # pid 0 is no process's, so no worker has this name on the shared database either
    nobody = f"weir-0@{os.uname().nodename}"
    assert_unhealthy(weir_health("worker", "--hostname", nobody, "--timeout-s", "1", broker_url=redis_url),
                     f"no answer from {nobody}")


def test_health_fails_when_the_broker_cannot_be_reached():
    with socket.socket() as probe:  # a port nothing listens on once the probe closes it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for process in ("worker", "beat"):
        done = weir_health(process, "--timeout-s", "2", broker_url=f"redis://:secret@127.0.0.1:{port}/0")
        assert_unhealthy(done, f"weir health {process}: cannot reach the broker at redis://:**@127.0.0.1:{port}/0")
        assert "secret" not in done.stderr


def test_health_needs_a_broker_url():
    done = weir_health("worker", broker_url=None)
    assert done.returncode == 2
    assert done.stderr == "weir health worker: WEIR_BROKER_URL is not set\n"


@pytest.mark.integration
def test_health_beat_passes_while_beat_ticks(private_broker_url, queue, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               WEIR_BROKER_URL=private_broker_url, WEIR_QUEUE=queue)
    log_path = tmp_path / "beat.log"
    with open(log_path, "wb") as log:
        # the compose beat service's command, with a schedule file of its own
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "weir.worker.app:app", "beat", "--loglevel", "INFO",
             "--enable-remote-control", "--max-interval", "1", "--schedule", str(tmp_path / "schedule")],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # beat's control thread connects after the scheduler starts
            done = weir_health("beat", "--timeout-s", "1", broker_url=private_broker_url)
            if done.returncode == 0 or time.monotonic() > deadline or beat.poll() is not None:
                break
        assert done.returncode == 0, f"{done.stderr}\n{log_path.read_text()[-4000:]}"
        assert done.stdout == f"weir health beat: celerybeat@{os.uname().nodename} answered on {private_broker_url}\n"
        beat.send_signal(signal.SIGTERM)
        beat.wait(30)
    finally:
        if beat.poll() is None:
            beat.kill()
            beat.wait()
    assert_unhealthy(weir_health("beat", "--timeout-s", "1", broker_url=private_broker_url),
                     f"no answer from celerybeat@{os.uname().nodename}")


@pytest.mark.integration
def test_health_beat_passes_for_the_beat_embedded_in_a_worker(worker_env, private_broker_url, tmp_path):
    # its own folder, for beat's schedule file (celerybeat-schedule)
    worker = WorkerProcess(dict(worker_env, WEIR_BROKER_URL=private_broker_url), str(tmp_path / "worker.log"),
                           argv=[sys.executable, "-m", "weir", "worker", "--beat", "--loglevel", "INFO"],
                           cwd=str(tmp_path))
    try:
        worker.wait_ready()
        deadline = time.monotonic() + 60
        while True:  # beat's control thread connects after its scheduler starts
            done = weir_health("beat", "--timeout-s", "1", broker_url=private_broker_url)
            if done.returncode == 0 or time.monotonic() > deadline or not worker.is_alive():
                break
        assert done.returncode == 0, f"{done.stderr}\n{worker.log()[-4000:]}"
        assert done.stdout == f"weir health beat: celerybeat@{os.uname().nodename} answered on {private_broker_url}\n"
        assert worker.terminate() == 0
    finally:
        worker.kill()
    assert_unhealthy(weir_health("beat", "--timeout-s", "1", broker_url=private_broker_url),
                     f"no answer from celerybeat@{os.uname().nodename}")


def test_every_standalone_beat_command_in_the_readme_answers_remote_control(compose):
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        commands = re.findall(r"`(celery [^`]* beat\b[^`]*)`", f.read())
    assert commands
    for command in commands:
        assert "--enable-remote-control" in command.split(), command
    # the same flags as compose's beat service
    assert set(compose["services"]["beat"]["entrypoint"]) >= set(commands[0].split())
