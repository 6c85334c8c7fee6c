"""What producers import: request models and functions to enqueue jobs and read their results.

    from weir import jobs
    batch_id = jobs.enqueue_batch([jobs.GenerateRequest(prompt="Hello", max_tokens=8)])
    jobs.wait(batch_id, timeout_s=60)
    rows = jobs.results(batch_id)

The functions use a :class:`weir.jobs.client.Client` built once from the settings (``WEIR_*``);
build your own ``Client(settings)`` to target another database or broker.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from weir.jobs.schemas import ChatMessage, ClassifyRequest, GenerateRequest, ResponseFormat, parse_request

__all__ = [
    "Client",
    "ChatMessage",
    "GenerateRequest",
    "ClassifyRequest",
    "ResponseFormat",
    "parse_request",
    "default_client",
    "enqueue_generate",
    "enqueue_classify",
    "enqueue_batch",
    "batch_status",
    "wait",
    "results",
]


def __getattr__(name):  # lazy: the request models must not pull SQLAlchemy and Celery
    if name == "Client":
        from weir.jobs.client import Client

        return Client
    raise AttributeError(f"module 'weir.jobs' has no attribute {name!r}")


@lru_cache(maxsize=1)
def default_client():
    """The process-wide :class:`weir.jobs.client.Client` for :func:`weir.config.get_settings`."""
    from weir.jobs.client import Client

    return Client()


def enqueue_generate(prompt: Any, **fields: Any):
    """See :meth:`weir.jobs.client.Client.enqueue_generate`."""
    return default_client().enqueue_generate(prompt, **fields)


def enqueue_classify(prompt: Any, labels: list[str], **fields: Any):
    """See :meth:`weir.jobs.client.Client.enqueue_classify`."""
    return default_client().enqueue_classify(prompt, labels, **fields)


def enqueue_batch(requests, **kwargs: Any):
    """See :meth:`weir.jobs.client.Client.enqueue_batch`."""
    return default_client().enqueue_batch(requests, **kwargs)


def batch_status(batch_id):
    """See :meth:`weir.jobs.client.Client.batch_status`."""
    return default_client().batch_status(batch_id)


def wait(batch_id, timeout_s=None, **kwargs: Any):
    """See :meth:`weir.jobs.client.Client.wait`."""
    return default_client().wait(batch_id, timeout_s, **kwargs)


def results(batch_id):
    """See :meth:`weir.jobs.client.Client.results`."""
    return default_client().results(batch_id)
