"""weir's settings: one object, split by concern, read from ``WEIR_*`` environment variables.

This is the only module that reads the environment. Values discovered at run time (the number of
KV blocks that fit in memory, say) live in runtime objects and are never written back here.

Every field maps to one flat variable: ``WEIR_MODEL``, ``WEIR_BLOCK_SIZE``, ``WEIR_BROKER_URL``,
``WEIR_DATABASE_URL`` and so on.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weir.engine.engine_args import normalize_dtype
# the packaged model's location lives with the other model references (the engine needs it
# without pydantic); named here too for the settings' users
from weir.model_source import DEFAULT_GGUF_FILE, DEFAULT_MODEL_PACKAGE, default_model_path  # noqa: F401

DEFAULT_SWEEP_AFTER_S = 60.0


class _WeirSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore", protected_namespaces=())


class EngineSettings(_WeirSettings):
    """What model runs and how requests are batched: the fields of
    :class:`weir.engine.engine_args.EngineArgs` (vLLM's engine arguments), with its defaults
    (``tests/test_settings.py`` holds the two together)."""

    model: str = Field("", description="GGUF file, local Hugging Face folder; empty = packaged SmolLM2")
    tokenizer: Optional[str] = None
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: str = Field("auto", description="auto, half/float16, bfloat16/bf16, float/float32 (vLLM's names)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: Optional[int] = Field(None, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    seed: int = 0
    enforce_eager: bool = Field(False, description="on CUDA, run every step eagerly (no CUDA graphs)")
    max_logprobs: int = Field(20, ge=0, description="most log-probabilities a request may ask for per position")
    cudagraph_mode: str = Field("FULL_AND_PIECEWISE", description="NONE, PIECEWISE, FULL_DECODE_ONLY, "
                                "FULL_AND_PIECEWISE (vLLM's names)")
    cudagraph_capture_sizes: Optional[list[int]] = Field(None, description="piecewise CUDA-graph token counts")
    max_cudagraph_capture_size: Optional[int] = Field(None, gt=0, description="largest piecewise bucket (2048)")
    measure_step_gpu_time: bool = Field(False, description="time each step's forward with CUDA events")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority", description="priority (each job's priority, lower first) or fcfs (arrival order); vLLM's "
        "names, though vLLM's default is fcfs: a worker serves interactive jobs beside bulk ones")
    strict_priority: Optional[bool] = Field(
        None, validate_default=True, description="with scheduling_policy=priority, step only the jobs of the best "
        "priority present; the others wait with their KV blocks. Default: true with the priority policy")

    @field_validator("dtype")
    @classmethod
    def _canonical_dtype(cls, dtype: str) -> str:
        return normalize_dtype(dtype)

    @field_validator("strict_priority")
    @classmethod
    def _strict_needs_priority(cls, strict: Optional[bool], info: ValidationInfo) -> bool:
        priority = info.data.get("scheduling_policy") == "priority"
        if strict is None:
            return priority
        if strict and not priority:
            raise ValueError("true needs WEIR_SCHEDULING_POLICY=priority")
        return strict


class CacheSettings(_WeirSettings):
    """The paged KV cache: block size, how much memory it takes, prefix caching."""

    block_size: int = Field(16, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kv_cache_bytes: int = Field(1 << 30, gt=0, description="KV-cache size on CPU, bytes")
    num_gpu_blocks_override: Optional[int] = Field(None, gt=0, description="fix the number of KV blocks")
    enable_prefix_caching: bool = True


class WorkerSettings(_WeirSettings):
    """The Celery side: broker, queue, concurrency, and the time limits of delivery.

    The limits nest (README "Guarantees"): Redis redelivers a message ``visibility_timeout_s``
    after it was *fetched*, whether or not its job started, so one delivery must end well within
    it: a job waits at most one other job's run in the prefetch buffer, runs at most
    ``job_timeout_s``, then may spend ``db_retry_timeout_s`` storing its result.
    :meth:`delivery_problems` names any setting that breaks this.
    """

    broker_url: Optional[str] = Field(None, description="Redis URL, redis://host:port/db")
    queue: Optional[str] = Field(None, description="queue name; default derived from the model")
    concurrency: Optional[int] = Field(None, gt=0, description="task threads and prefetch window of the model's "
                                       "queue (bulk chunks); default max_num_seqs")
    interactive_concurrency: Optional[int] = Field(
        None, gt=0, description="task threads and prefetch window of the model's interactive queue (priority-0 "
        "jobs, consumed on a channel of its own); default max_num_seqs")
    visibility_timeout_s: int = Field(3600, gt=0, description="Redis redelivers an unacked message this long after its fetch")
    job_timeout_s: float = Field(600.0, gt=0, description="one attempt of a job in the engine, seconds from its first scheduling")
    max_attempts: int = Field(3, ge=1, description="attempts (deliveries that started the job) before it fails")
    db_retry_timeout_s: float = Field(300.0, ge=0, description="retry transient database errors this long")
    shutdown_timeout_s: float = Field(60.0, ge=0, description="warm shutdown: running jobs get this long")
    cancel_poll_interval_s: float = Field(2.0, gt=0, description="a running job checks for cancel this often")
    lease_s: float = Field(30.0, gt=0, description="a claim's lease, renewed while the job runs, seconds")
    bulk_chunk_size: int = Field(
        256, ge=1, description="a bulk batch (priority above 0) is published as one message per this many jobs; "
        "1: one message per job")
    commit_max_jobs: int = Field(256, gt=0, description="group commit: the most jobs one transaction writes")
    commit_max_wait_s: float = Field(0.005, ge=0, description="group commit: wait this long for more jobs")
    engine_multiprocessing: bool = Field(
        True, description="run the engine core (the step loop) in a process of its own, as vLLM V1 does; "
        "false: a thread of the worker's process")
    engine_iteration_timeout_s: float = Field(
        60.0, gt=0, description="a busy engine core silent this long is taken for wedged and killed, seconds")
    cpu_omp_threads_bind: str = Field(
        "auto", description="CPUs of the engine core's intra-op threads (vLLM's VLLM_CPU_OMP_THREADS_BIND): "
        "auto, nobind, or a CPU list such as 0-3,8 (the job side gets the others)")
    cpu_num_of_reserved_cpu: Optional[int] = Field(
        None, ge=0, description="auto: CPUs the job side keeps, the engine core getting the rest; "
        "default 0 on hosts of up to 2 CPUs, else 1")
    max_engine_failures: int = Field(
        3, ge=1, description="engine steps failing in a row before the worker exits non-zero")
    sweep_interval_s: float = Field(30.0, gt=0, description="beat runs the sweeper this often")
    sweep_after_s: Optional[float] = Field(
        None, gt=0, description="a message missing this long is lost and published again; default 60 s"
    )
    metrics_port: Optional[int] = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics on this port (/metrics); unset or 0 = off")
    log_stats_interval_s: float = Field(
        10.0, ge=0, description="log the engine's throughput and cache line this often, seconds; 0 = off")
    task_send_sent_event: bool = Field(
        False, description="producers send Celery's task-sent event per job (Flower sees jobs from publication "
        "on); halves the publish rate")
    catalog_path: Optional[str] = Field(None, description="catalog CSV the nightly enrichment reads")
    catalog_schedule: str = Field("0 2 * * *", description="cron line (UTC) of the nightly enrichment")
    catalog_spec: Optional[str] = Field(
        None, description="job spec of the nightly enrichment: a TOML file or a shipped name (bigbasket, flipkart)")

    @field_validator("broker_url")
    @classmethod
    def _broker_url_has_a_scheme(cls, url: Optional[str]) -> Optional[str]:
        # kombu reads a URL without "://" as a host name on its default transport, AMQP, and
        # would retry connecting to it forever
        if url and "://" not in url:
            raise ValueError(f"{url!r} is not a broker URL (expected redis://host:port/db)")
        # the sweeper, the queue checks and the priority levels read Redis lists: Redis only
        if url and url.split("://", 1)[0].lower() not in ("redis", "rediss", "redis+socket"):
            raise ValueError(f"{url!r} is not a Redis URL (expected redis://host:port/db or rediss://...); "
                             "weir runs on Redis only")
        return url or None

    @field_validator("cpu_omp_threads_bind")
    @classmethod
    def _bind_is_auto_nobind_or_a_cpu_list(cls, bind: str) -> str:
        from weir.worker.placement import parse_cpu_list

        bind = bind.strip()
        if bind not in ("auto", "nobind"):
            parse_cpu_list(bind)  # its ValueError names the value
        return bind

    @property
    def sweep_deadline_s(self) -> float:
        """How long a job's message must be missing before the sweeper publishes it again (seconds):
        past its lease's expiry (running), or past the queue's oldest waiting message (queued)."""
        return self.sweep_after_s or DEFAULT_SWEEP_AFTER_S

    def delivery_problems(self) -> list[str]:
        """Settings under which a healthy job would be delivered twice; empty when consistent.

        Returns:
            One sentence per problem, naming the ``WEIR_*`` variables involved.
        """
        one_delivery_s = 2 * self.job_timeout_s + self.db_retry_timeout_s
        problems = []
        if self.visibility_timeout_s <= one_delivery_s:
            problems.append(
                f"WEIR_VISIBILITY_TIMEOUT_S={self.visibility_timeout_s} is not above "
                f"2 * WEIR_JOB_TIMEOUT_S + WEIR_DB_RETRY_TIMEOUT_S = {one_delivery_s:g}: "
                "Redis will deliver slow jobs a second time while they still run"
            )
        if self.lease_s <= 2 * self.cancel_poll_interval_s:
            problems.append(
                f"WEIR_LEASE_S={self.lease_s:g} is not above 2 * WEIR_CANCEL_POLL_INTERVAL_S = "
                f"{2 * self.cancel_poll_interval_s:g}: leases of running jobs would expire between renewals"
            )
        return problems


class DatabaseSettings(_WeirSettings):
    """Where results go. Empty URL = a local SQLite file (embedded mode)."""

    database_url: Optional[str] = None
    sqlite_path: str = "weir.db"
    connect_timeout_s: int = Field(5, gt=0, description="Postgres connect timeout, seconds")
    statement_timeout_s: float = Field(30.0, gt=0, description="Postgres statement_timeout, seconds")
    lock_timeout_s: float = Field(10.0, gt=0, description="Postgres lock_timeout, seconds")
    pool_size: Optional[int] = Field(None, gt=0, description="connections kept open (as many again as overflow); default 5")
    pool_timeout_s: float = Field(30.0, gt=0, description="wait this long for a pooled connection, seconds")

    def url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"


class Settings(_WeirSettings):
    engine: EngineSettings = Field(default_factory=EngineSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)

    def engine_args(self) -> dict:
        """Keyword arguments for ``weir.engine.LLM`` (:class:`weir.engine.engine_args.EngineArgs`)
        built from the engine and cache settings; an empty ``model`` becomes None."""
        args = self.engine.model_dump()
        args.update(self.cache.model_dump())
        args["model"] = args["model"] or None
        return args


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
