"""The worker's Prometheus metrics (``weir.worker.metrics``) and the periodic stats line: the
engine's counters, gauges and histograms against a tiny model's exact token counts, a scrape of a
real ``weir worker`` after a small batch, the Grafana dashboard's metric names, Celery's events."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.conftest import REPO_ROOT
from weir.engine import LLM, SamplingParams
from weir.engine.stats import LoggingStatLogger
from weir.worker.metrics import WorkerMetrics, attach

DASHBOARD = os.path.join(REPO_ROOT, "worker", "grafana_dashboard.json")
GREEDY_5 = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def samples(text: str) -> dict:
    """``{(sample name, ((label, value), ...)): value}`` of a Prometheus text exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def registry_samples(metrics: WorkerMetrics) -> dict:
    from prometheus_client import generate_latest

    return samples(generate_latest(metrics.registry).decode())


def engine_value(found: dict, name: str, model_name: str) -> float:
    return found[(name, (("model_name", model_name),))]


# ---- the engine's side, through LLM --------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks_override=64, max_num_seqs=2)


def test_engine_counters_gauges_and_histograms_are_exact(llm):
    metrics = WorkerMetrics()
    attach(metrics, llm)
    name = llm.model_name
    llm.reset_prefix_cache()
    shared = list(range(300, 337))  # 37 tokens: two full 16-token blocks
    prompts = [shared + [400 + i] for i in range(3)]  # 38 tokens each
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY_5) for p in prompts]

    engine.step()  # max_num_seqs=2: two run, one waits

    found = registry_samples(metrics)
    assert engine_value(found, "weir:num_requests_running", name) == 2
    assert engine_value(found, "weir:num_requests_waiting", name) == 1
    # the first request's 3 blocks, and the second's own third block after its 2 prefix hits
    assert engine_value(found, "weir:kv_cache_usage_perc", name) == 4 / 64
    assert engine_value(found, "weir:prompt_tokens_total", name) == 3 * 38
    assert engine_value(found, "weir:prefix_cache_queries_total", name) == 2 * 38
    assert engine_value(found, "weir:prefix_cache_hits_total", name) == 32

    while engine.has_unfinished():
        engine.step()
    outs = llm.generate([list(range(500, 510))], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4,
                                                                ignore_eos=True))
    classified = llm.classify([list(range(600, 620))], ["Tea", "Soap"])

    found = registry_samples(metrics)
    assert len(ids) == 3 and len(outs[0].outputs) == 2 and classified[0].label in ("Tea", "Soap")
    assert engine_value(found, "weir:prompt_tokens_total", name) == 3 * 38 + 10 + 20
    assert engine_value(found, "weir:generation_tokens_total", name) == 3 * 5 + 2 * 4
    assert engine_value(found, "weir:prefix_cache_queries_total", name) == 3 * 38 + 10 + 20  # forks: no lookup
    assert engine_value(found, "weir:prefix_cache_hits_total", name) == 2 * 32
    assert engine_value(found, "weir:num_preemptions_total", name) == 0
    assert engine_value(found, "weir:num_requests_running", name) == 0
    assert engine_value(found, "weir:num_requests_waiting", name) == 0
    assert engine_value(found, "weir:kv_cache_usage_perc", name) == 0.0
    # one observation per finished generation request (n=2 is one request); none for classification
    for histogram in ("weir:time_to_first_token_seconds", "weir:e2e_request_latency_seconds",
                      "weir:request_queue_time_seconds"):
        assert engine_value(found, histogram + "_count", name) == 4
    # and they agree with LLM.stats()
    stats = llm.stats()
    assert stats["num_prompt_tokens"] == engine_value(found, "weir:prompt_tokens_total", name)
    assert stats["num_generation_tokens"] == engine_value(found, "weir:generation_tokens_total", name)
    engine.stat_loggers.clear()


def test_preemptions_are_counted(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=8, max_model_len=128,
              max_num_seqs=4)
    metrics = WorkerMetrics()
    attach(metrics, llm)
    llm.generate([list(range(3 + 40 * i, 33 + 40 * i)) for i in range(4)],
                 SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    preemptions = engine_value(registry_samples(metrics), "weir:num_preemptions_total", llm.model_name)
    assert preemptions == llm.stats()["num_preemptions"] > 0


def test_each_worker_has_its_own_registry():
    first, second = WorkerMetrics(), WorkerMetrics()  # no "Duplicated timeseries" error
    first.job_finished("generate", "succeeded", 0.5)
    assert registry_samples(first)[("weir:jobs_total", (("kind", "generate"), ("outcome", "succeeded")))] == 1
    assert registry_samples(second)[("weir:jobs_total", (("kind", "generate"), ("outcome", "succeeded")))] == 0
    assert first.registry is not second.registry


def test_queue_depth_that_cannot_be_read_is_nan():
    metrics = WorkerMetrics()

    def broken(queue):
        raise ConnectionError("broker down")

    metrics.watch_queues(broken, ["q"])
    value = registry_samples(metrics)[("weir:num_waiting_messages", (("queue", "q"),))]
    assert value != value  # NaN


def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^WEIR_METRICS_PORT={port}: cannot listen on 127.0.0.1:{port}: "):
            WorkerMetrics().serve(port, addr="127.0.0.1")


# ---- the periodic line ---------------------------------------------------------------------------


def test_the_stats_line_is_vllms(caplog):
    now = [100.0]
    snapshot = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_requests_running": 0,
                "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0}
    stat_logger = LoggingStatLogger(lambda: dict(snapshot), clock=lambda: now[0])
    snapshot.update(num_prompt_tokens=12345, num_generation_tokens=5678, num_requests_running=12,
                    num_requests_waiting=3, kv_cache_usage_perc=0.412, prefix_cache_queries=1000,
                    prefix_cache_hits=870)
    now[0] += 10.0
    with caplog.at_level(logging.DEBUG, logger="weir.engine.stats"):
        line = stat_logger.log()
        snapshot.update(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0)
        now[0] += 10.0
        idle = stat_logger.log()
        now[0] += 10.0
        stat_logger.log()

    assert line == ("Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 567.8 tokens/s, "
                    "Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 87.0%")
    assert idle == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                    "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    # the first idle window is logged at INFO, the ones after it at DEBUG
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


# ---- the Grafana dashboard -----------------------------------------------------------------------

HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def dashboard_metric_names() -> set[str]:
    with open(DASHBOARD, encoding="utf-8") as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    names = set()
    for name in re.findall(r"weir:[a-zA-Z0-9_:]+", " ".join(exprs)):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        names.add(name)
    return names


def test_the_dashboard_charts_every_exported_metric_and_nothing_else():
    assert dashboard_metric_names() == WorkerMetrics().names


def test_every_dashboard_panel_has_a_place_and_a_query():
    with open(DASHBOARD, encoding="utf-8") as f:
        dashboard = json.load(f)
    for p in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]


# ---- a real worker -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


class TaskEvents:
    """Celery events of one worker, captured from the broker in a thread (what Flower reads)."""

    def __init__(self, broker_url: str, hostname: str):
        from celery import Celery

        self.app = Celery("weir-test-events", broker=broker_url, set_as_current=False)
        self.hostname = hostname
        self.types: list[str] = []
        self.ready = threading.Event()
        self._connection = self.app.connection_for_read()
        self._receiver = self.app.events.Receiver(self._connection, handlers={"*": self._on_event})
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_event(self, event: dict) -> None:
        if event.get("hostname") == self.hostname and event["type"].startswith("task-"):
            self.types.append(event["type"])

    def _run(self) -> None:
        self.ready.set()
        try:
            self._receiver.capture(limit=None, timeout=None, wakeup=False)
        except Exception:  # the connection is closed under it at the end
            pass

    def close(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(5)
        self._connection.release()


@pytest.mark.integration
def test_a_scrape_after_a_batch_has_exact_counts(start_worker, client, worker_env):
    from weir.jobs.model_info import PromptChecker, load_tokenizer
    from weir.jobs.schemas import ClassifyRequest, GenerateRequest
    from weir.model_source import model_name

    port = free_port()
    worker = start_worker(WEIR_METRICS_PORT=str(port), WEIR_LOG_STATS_INTERVAL_S="0.2")
    events = TaskEvents(worker_env["WEIR_BROKER_URL"], worker.hostname)
    assert events.ready.wait(10)
    # this producer believes the model takes 100k tokens, so the worker's engine is the one to refuse
    client.prompt_checker = PromptChecker(load_tokenizer(worker_env["WEIR_MODEL"]), 100_000)
    requests = [GenerateRequest(prompt=f"Item {i}", custom_id=f"gen-{i}", temperature=0, max_tokens=4)
                for i in range(3)]
    requests.append(GenerateRequest(prompt="Two of them", custom_id="n2", n=2, temperature=0.7, seed=3,
                                    max_tokens=3))
    requests += [ClassifyRequest(prompt=f"Product: Tea {i}", labels=["Tea", "Soap"], custom_id=f"cls-{i}")
                 for i in range(2)]
    requests.append(GenerateRequest(prompt="word " * 600, custom_id="too-long", max_tokens=4))
    batch_id = client.enqueue_batch(requests)
    client.wait(batch_id, timeout_s=120)
    results = list(client.results(batch_id))

    def jobs_total(found):
        return sum(v for (n, _), v in found.items() if n == "weir:jobs_total")

    deadline = time.monotonic() + 30  # an outcome is counted just after its commit, which the client saw
    found = scrape(port)
    while jobs_total(found) < len(requests) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = scrape(port)
    events.close()

    model = (("model_name", model_name(worker_env["WEIR_MODEL"])),)
    assert found[("weir:jobs_total", (("kind", "generate"), ("outcome", "succeeded")))] == 4
    assert found[("weir:jobs_total", (("kind", "classify"), ("outcome", "succeeded")))] == 2
    assert found[("weir:jobs_total", (("kind", "generate"), ("outcome", "failed")))] == 1
    assert jobs_total(found) == 7
    assert found[("weir:job_attempts_total", (("kind", "generate"),))] == 5
    assert found[("weir:job_attempts_total", (("kind", "classify"),))] == 2
    assert found[("weir:job_duration_seconds_count", (("kind", "generate"),))] == 5
    assert found[("weir:job_duration_seconds_count", (("kind", "classify"),))] == 2
    assert found[("weir:prompt_tokens_total", model)] == sum(r["num_prompt_tokens"] or 0 for r in results)
    assert found[("weir:generation_tokens_total", model)] == sum(r["num_completion_tokens"] or 0 for r in results)
    for histogram in ("weir:time_to_first_token_seconds", "weir:e2e_request_latency_seconds",
                      "weir:request_queue_time_seconds"):
        assert found[(histogram + "_count", model)] == 4  # the generation jobs the engine ran
    assert found[("weir:num_preemptions_total", model)] == 0
    assert found[("weir:num_requests_running", model)] == 0
    assert found[("weir:num_requests_waiting", model)] == 0
    assert found[("weir:kv_cache_usage_perc", model)] == 0.0
    queue = worker_env["WEIR_QUEUE"]
    assert found[("weir:num_waiting_messages", (("queue", queue),))] == 0
    assert found[("weir:num_waiting_messages", (("queue", queue + ".control"),))] == 0
    assert found[("weir:num_waiting_messages", (("queue", queue + ".interactive"),))] == 0
    # 7 claims and 7 outcomes, grouped into at least one transaction per lane
    for lane in ("claim", "finish"):
        assert 1 <= found[("weir:db_write_latency_seconds_count", (("lane", lane),))] <= 7
    # the periodic line, and Celery's task events for Flower
    assert re.search(r"Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
                     r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [0-9.]+%, "
                     r"Prefix cache hit rate: [0-9.]+%", worker.log())
    assert events.types.count("task-succeeded") == 7 and events.types.count("task-received") == 7
    assert worker.terminate() == 0


ENGINE_SERIES = ("weir:num_requests_running", "weir:num_requests_waiting", "weir:kv_cache_usage_perc",
                 "weir:num_preemptions_total", "weir:prefix_cache_queries_total", "weir:prefix_cache_hits_total",
                 "weir:prompt_tokens_total", "weir:generation_tokens_total",
                 "weir:time_to_first_token_seconds_count", "weir:e2e_request_latency_seconds_count",
                 "weir:request_queue_time_seconds_count")


@pytest.mark.integration
def test_a_scrape_before_any_job_has_every_engine_series_at_zero(start_worker, worker_env):
    from weir.model_source import model_name

    port = free_port()
    worker = start_worker(WEIR_METRICS_PORT=str(port))
    found = scrape(port)
    model = (("model_name", model_name(worker_env["WEIR_MODEL"])),)
    assert {name: found.get((name, model)) for name in ENGINE_SERIES} == dict.fromkeys(ENGINE_SERIES, 0.0)
    for histogram in ("weir:time_to_first_token_seconds", "weir:e2e_request_latency_seconds",
                      "weir:request_queue_time_seconds"):
        assert found[(histogram + "_bucket", (("le", "+Inf"), *model))] == 0.0
    # the pipeline's, for every kind, outcome and lane, before the first of each
    for kind in ("generate", "classify"):
        for outcome in ("succeeded", "failed"):
            assert found[("weir:jobs_total", (("kind", kind), ("outcome", outcome)))] == 0.0
        assert found[("weir:job_attempts_total", (("kind", kind),))] == 0.0
        assert found[("weir:job_duration_seconds_count", (("kind", kind),))] == 0.0
    for lane in ("claim", "finish"):
        assert found[("weir:db_write_latency_seconds_count", (("lane", lane),))] == 0.0
    assert worker.terminate() == 0
