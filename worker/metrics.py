"""The worker's Prometheus metrics: every metric name weir exports is defined here.

Names follow vLLM's (``vllm:num_requests_running`` ... becomes ``weir:num_requests_running``),
with the engine's labelled by ``model_name`` as vLLM labels them, plus the pipeline's own
(``weir:jobs_total``, ``weir:job_attempts_total``, ``weir:job_duration_seconds``,
``weir:db_write_latency_seconds``, ``weir:num_waiting_messages``). Each is updated where it is
known, at the cost of a few counter increments per engine step and one histogram observation per
finished request, job or transaction:

- the engine's gauges, counters and request-latency histograms: :class:`PrometheusStatLogger`, a
  stat logger of the engine (:mod:`weir.engine.stats`), called after each step in its step thread;
- jobs and attempts: :func:`weir.worker.attempt.run_attempt`, once a claim or an outcome committed;
- database write latency: the group committer, once per committed transaction;
- queue depth: asked of the broker at each scrape.

One :class:`WorkerMetrics` per worker runtime, each with its own ``CollectorRegistry`` (never
prometheus-client's global one), so one process can hold several; :meth:`WorkerMetrics.serve`
starts prometheus-client's HTTP server on ``WEIR_METRICS_PORT``.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from weir.engine.stats import IterationStats, SchedulerStats
from weir.jobs.db import JobKind, JobStatus

logger = logging.getLogger(__name__)

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                             60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# a group commit's transaction: a millisecond when all is well, up to the watchdog's 35 s when not
DB_WRITE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0, 60.0)


JOB_KINDS = tuple(kind.value for kind in JobKind)
JOB_OUTCOMES = (JobStatus.SUCCEEDED.value, JobStatus.FAILED.value)
DB_WRITE_LANES = ("claim", "finish")
"""The ``lane`` of ``weir:db_write_latency_seconds``: claims; results and releases."""


class MetricsPortUnavailable(ValueError):
    """``WEIR_METRICS_PORT`` cannot be listened on; the message is one line naming the variable,
    the port and the system's reason (``WEIR_METRICS_PORT=8000: cannot listen on 0.0.0.0:8000:
    Address already in use``)."""

    def __init__(self, port: int, addr: str, exc: OSError):
        super().__init__(f"WEIR_METRICS_PORT={port}: cannot listen on {addr}:{port}: {exc.strerror or exc}")


def check_port(port: int, addr: str = "0.0.0.0") -> None:
    """Bind ``addr:port`` once and let it go, as :meth:`WorkerMetrics.serve` would bind it
    (``SO_REUSEADDR``, as prometheus-client's ``http.server``), so that ``weir worker`` refuses a
    busy port before it loads the model.

    Raises:
        MetricsPortUnavailable: the port cannot be listened on (in use, or not allowed).
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((addr, port))
            probe.listen()
        except OSError as exc:
            raise MetricsPortUnavailable(port, addr, exc) from None


class WorkerMetrics:
    """Every metric of one worker, in its own registry.

    Args:
        registry: where they are registered; default a new ``CollectorRegistry``.
    """

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        engine = ["model_name"]
        # the engine (vLLM's names and help texts)
        self.kv_cache_usage_perc = Gauge("weir:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                         engine, registry=r)
        self.num_requests_running = Gauge("weir:num_requests_running", "Number of requests in model execution batches.",
                                          engine, registry=r)
        self.num_requests_waiting = Gauge("weir:num_requests_waiting", "Number of requests waiting to be processed.",
                                          engine, registry=r)
        self.num_preemptions = Counter("weir:num_preemptions", "Cumulative number of preemption from the engine.",
                                       engine, registry=r)
        self.prefix_cache_queries = Counter(
            "weir:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", engine, registry=r)
        self.prefix_cache_hits = Counter(
            "weir:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", engine, registry=r)
        self.prompt_tokens = Counter("weir:prompt_tokens", "Number of prefill tokens processed.", engine, registry=r)
        self.generation_tokens = Counter("weir:generation_tokens", "Number of generation tokens processed.",
                                         engine, registry=r)
        self.time_to_first_token = Histogram(
            "weir:time_to_first_token_seconds", "Histogram of time to first token in seconds.", engine,
            buckets=TTFT_BUCKETS_S, registry=r)
        self.e2e_request_latency = Histogram(
            "weir:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", engine,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.request_queue_time = Histogram(
            "weir:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", engine,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        # the pipeline
        self.jobs = Counter("weir:jobs", "Jobs whose outcome this worker committed, by kind and outcome "
                            "(succeeded, failed).", ["kind", "outcome"], registry=r)
        self.job_attempts = Counter("weir:job_attempts", "Claims of a job that started a run (each counts "
                                    "toward WEIR_MAX_ATTEMPTS unless given back).", ["kind"], registry=r)
        self.job_duration = Histogram(
            "weir:job_duration_seconds", "From a job's claim to its outcome committed, in seconds.", ["kind"],
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.db_write_latency = Histogram(
            "weir:db_write_latency_seconds", "One group-commit transaction, from its first statement to its "
            "commit, in seconds, by lane (claim; finish: results and releases).", ["lane"],
            buckets=DB_WRITE_BUCKETS_S, registry=r)
        self.num_waiting_messages = Gauge(
            "weir:num_waiting_messages", "Messages waiting in a queue this worker consumes (not counting those "
            "workers hold unacked); NaN when the broker cannot be asked.", ["queue"], registry=r)
        # A series appears at zero from the start for every label value known beforehand, not with
        # its first event: Prometheus' rate() and alerts see "none yet" instead of "no data".
        for kind in JOB_KINDS:
            self.job_attempts.labels(kind)
            self.job_duration.labels(kind)
            for outcome in JOB_OUTCOMES:
                self.jobs.labels(kind, outcome)
        for lane in DB_WRITE_LANES:
            self.db_write_latency.labels(lane)
        self._server = None

    @property
    def names(self) -> set[str]:
        """The metric family names registered (as exposed, ``_total`` included for counters)."""
        names = set()
        for family in self.registry.collect():
            names.add(family.name + "_total" if family.type == "counter" else family.name)
        return names

    # ---- the pipeline ---------------------------------------------------------------------------

    def job_started(self, kind: str) -> None:
        self.job_attempts.labels(kind).inc()

    def job_finished(self, kind: str, outcome: str, duration_s: float) -> None:
        """A job's outcome (``succeeded``/``failed``) committed ``duration_s`` seconds after its claim."""
        self.jobs.labels(kind, outcome).inc()
        self.job_duration.labels(kind).observe(duration_s)

    def watch_queues(self, num_waiting_messages: Callable[[str], int], queues: list[str]) -> None:
        """Report each queue's depth at scrape time as ``num_waiting_messages(queue)``; a call that
        raises reports NaN (a broker outage must not fail the scrape of every other metric)."""
        for queue in queues:
            self.num_waiting_messages.labels(queue).set_function(_or_nan(num_waiting_messages, queue))

    # ---- the HTTP endpoint ----------------------------------------------------------------------

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` (Prometheus' text format) on ``addr:port`` from a daemon thread.

        Raises:
            MetricsPortUnavailable: the port cannot be listened on (in use, or not allowed).
        """
        try:
            self._server, _ = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise MetricsPortUnavailable(port, addr, exc) from None
        logger.info("metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _or_nan(fn: Callable[[str], int], queue: str) -> Callable[[], float]:
    def value() -> float:
        try:
            return float(fn(queue))
        except Exception as exc:  # any broker error: report "unknown", keep the scrape
            logger.debug("cannot read the depth of %s: %s", queue, exc)
            return math.nan

    return value


class PrometheusStatLogger:
    """The engine's stat logger (:class:`weir.engine.stats.StatLoggerBase`) that updates the
    engine's metrics of a :class:`WorkerMetrics`: per step three gauges set and up to five
    counters increased; per finished generation request one observation in each of the three
    latency histograms. Made, every engine series is exposed at zero before the first step.

    Args:
        metrics: the metrics to update.
        model_name: their ``model_name`` label (the engine's ``model_name``).
    """

    def __init__(self, metrics: WorkerMetrics, model_name: str):
        m = metrics
        # labelled children looked up once, not per step
        self._gauges = (m.num_requests_running.labels(model_name), m.num_requests_waiting.labels(model_name),
                        m.kv_cache_usage_perc.labels(model_name))
        self._counters = (m.prompt_tokens.labels(model_name), m.generation_tokens.labels(model_name),
                          m.num_preemptions.labels(model_name), m.prefix_cache_queries.labels(model_name),
                          m.prefix_cache_hits.labels(model_name))
        self._queue_time = m.request_queue_time.labels(model_name)
        self._ttft = m.time_to_first_token.labels(model_name)
        self._e2e = m.e2e_request_latency.labels(model_name)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        running, waiting, kv = self._gauges
        running.set(scheduler_stats.num_running_reqs)
        waiting.set(scheduler_stats.num_waiting_reqs)
        kv.set(scheduler_stats.kv_cache_usage)
        it = iteration_stats
        for counter, amount in zip(self._counters, (it.num_prompt_tokens, it.num_generation_tokens,
                                                    it.num_preemptions, it.prefix_cache_queries,
                                                    it.prefix_cache_hits)):
            if amount:
                counter.inc(amount)
        for request in it.finished_requests:
            if request.queue_time_s is not None:
                self._queue_time.observe(request.queue_time_s)
            if request.time_to_first_token_s is not None:
                self._ttft.observe(request.time_to_first_token_s)
            if request.e2e_latency_s is not None:
                self._e2e.observe(request.e2e_latency_s)


def attach(metrics: WorkerMetrics, front: Any) -> PrometheusStatLogger:
    """Make ``front``'s engine (an ``LLM``, ``EngineFront`` or ``EngineCoreClient``) update ``metrics``
    after each step; returns the stat logger added to ``front.stat_loggers``. Call it before the
    first step."""
    stat_logger = PrometheusStatLogger(metrics, front.model_name)
    front.stat_loggers.append(stat_logger)
    return stat_logger
