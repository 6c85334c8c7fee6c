"""Task names and queue names: the contract between producers (``jobs``) and the worker.

Producers publish by name (``send_task``) so they never import the worker's code; the worker
registers its tasks under the same names. One queue per model: a worker consumes only the queue of
the model it has loaded.
"""

from __future__ import annotations

import re
from typing import Optional

RUN_JOB = "weir.run_job"
"""Run one job row. Args: ``(job_id: str)``."""

RUN_CHUNK = "weir.run_chunk"
"""A bulk batch's jobs, many to a message (args: their ids); see ``weir.worker.chunk``."""

ENRICH_CATALOG = "weir.enrich_catalog"
"""Enqueue one enrichment batch for a catalog file. Args: ``(catalog_path: str)``."""

SWEEP = "weir.sweep"
"""Publish again the jobs whose message may be lost (``weir.jobs.client.Client.sweep``). No args."""

QUEUE_PREFIX = "weir."

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def model_name(model: Optional[str]) -> str:
    """Short name of a model reference, the way the queue and the ``weir.jobs.model`` column spell
    it: the engine's ``LLM.model_name`` for the same reference (:func:`weir.model_source.model_name`).

    Args:
        model: a GGUF file path, a Hugging Face folder path, or None/"" for the packaged SmolLM2.
    """
    from weir.model_source import model_name as name_of

    return name_of(model)


CONTROL_SUFFIX = ".control"


def control_queue(queue: str) -> str:
    """The queue of a model queue's control tasks (sweep, nightly enrichment): its own, so they
    never wait behind the model queue's backlog. Every worker of the model consumes both."""
    return queue + CONTROL_SUFFIX


INTERACTIVE_SUFFIX = ".interactive"


def interactive_queue(queue: str) -> str:
    """The queue of a model queue's priority-0 jobs (single jobs, priority-0 batches): every
    worker of the model consumes it on a channel and prefetch window of its own
    (``WEIR_INTERACTIVE_CONCURRENCY``), so an interactive job never waits behind bulk chunks for a
    place in the worker's window."""
    return queue + INTERACTIVE_SUFFIX


BULK_SUFFIX = ".bulk"


def bulk_queue(queue: str) -> str:
    """The queue of a model queue's bulk chunks (``run_chunk`` messages of batches above priority
    0): every worker of the model consumes it on a channel and prefetch window of its own, no
    wider than the chunks that fill its engine, so the rest of a batch waits in the broker for
    whichever worker frees first, and the model queue's window stays free for per-job messages."""
    return queue + BULK_SUFFIX


def job_queues(queue: str) -> list[str]:
    """Every queue that carries a model queue's job messages: the queue itself (per-job messages
    of bulk jobs published again alone), its bulk queue (chunks), its interactive queue and its
    control queue (the sweeper's republished jobs)."""
    return [queue, bulk_queue(queue), interactive_queue(queue), control_queue(queue)]


def queue_for_model(model: Optional[str], override: Optional[str] = None) -> str:
    """Name of the Celery queue that serves ``model``: ``weir.<model name>`` unless overridden.

    Args:
        model: as for :func:`model_name`.
        override: an explicit queue name (``WEIR_QUEUE``); returned unchanged when given.
    """
    if override:
        return override
    return QUEUE_PREFIX + _UNSAFE.sub("-", model_name(model))
