"""OpenAI Batch files: read a request file into weir jobs, report a batch as an OpenAI Batch
object, write its results as OpenAI output and error lines.

The request file is JSON Lines, one request per line (OpenAI's Batch API, vLLM ``run-batch``)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}

Every line has exactly ``custom_id`` (unique in the file, 1 to 256 characters), ``method``
(``"POST"``), ``url`` and ``body``; every line has the same ``url`` (a batch has one endpoint).
Blank lines are skipped; line numbers count every line from 1.

Endpoints and how a body maps onto weir's requests (:mod:`weir.jobs.schemas`):

``/v1/chat/completions`` -> ``GenerateRequest`` with ``prompt`` = ``messages`` (roles ``system``,
``user``, ``assistant``; ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts,
joined). ``/v1/completions`` -> ``GenerateRequest`` with ``prompt`` = ``prompt`` (one string).
Both take ``max_tokens`` (or, chat only, ``max_completion_tokens``: give one), ``temperature``,
``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty`` under their own
names; chat's ``logprobs: true`` with ``top_logprobs: k`` is weir's ``logprobs = k`` (the sampled
token plus the top ``k``), completions' ``logprobs: k`` is the same, and the output lists the
``k`` most likely tokens per position, the sampled one among them when it ranks within ``k``, as
OpenAI does (:func:`top_entries`); ``response_format``
(OpenAI's shapes) is weir's own field. vLLM's extra sampling names (``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ...) are taken too.

``/v1/classifications`` (weir's extension, not OpenAI's) -> ``ClassifyRequest``: ``prompt`` (a
string or chat messages), ``labels``, and optionally ``label_texts``, ``calibration_prompt``,
``system_prompt``.

``model`` is optional (as in vLLM); when given it must be the workers' model name (the name
``weir.jobs.names.model_name`` gives ``WEIR_MODEL``, the ``jobs.model`` column's), else the line is
refused. Any other body field is refused by name, and so is ``stream: true``.

A file is taken whole or not at all: :func:`parse_batch_file` reads every line and raises one
:class:`BatchFileError` naming each bad line's number and field (the first
:data:`MAX_REPORTED_ERRORS`, in line order), bad JSON, bad fields and, given the model's
:class:`weir.jobs.model_info.PromptChecker`, prompts that do not fit ``max_model_len`` and limits of
the engine alike; nothing is stored.

The batch keeps its OpenAI fields in ``batches.metadata`` (no column of its own): under the key
:data:`META_KEY` the ``endpoint``, ``input_file_id`` (the file's path), ``completion_window`` and,
once expired, ``expired_at``; the caller's ``--metadata`` pairs beside it, at the top level.

Statuses (:func:`openai_status`): weir ``validating`` -> ``validating``; ``queued`` and
``in_progress`` -> ``in_progress`` (OpenAI has no queued state: the file is valid and waits for
workers); ``completed`` -> ``completed``; ``failed`` (every job failed) -> ``completed`` too, with
``request_counts.failed == total`` (OpenAI's ``failed`` is a file refused at validation, which
weir never stores); ``cancelled`` -> ``cancelled``, or ``expired`` when :func:`expire_if_due`
cancelled it. ``cancelling`` and ``finalizing`` are never reported: a cancel is one transaction,
and the output files are written on request (``weir batch results``), not staged.

Results: ``weir batch results`` writes what OpenAI's ``output_file_id`` and ``error_file_id`` hold,
one :func:`result_line` per finished request in submission order: a succeeded request's in the output
file, a failed, cancelled or expired one's in the error file (never in the output file; by default
:func:`error_file_path`), both written whole even when empty.

Expiry: a batch not finished when its completion window has passed (``created_at +
completion_window``) is expired by the next sweep (:func:`expire_due_batches`, the sweeper's rule
registered by this package; ``weir batch status``, ``cancel`` and ``results`` also call
:func:`expire_if_due` first), as OpenAI does it: its unfinished jobs are cancelled, finished
ones keep their results, and it reads ``expired`` from then on; its cancelled requests appear in
the error file with code ``batch_expired``.
"""

from weir.jobs.openai_batch.batch import (  # noqa: F401  (the application's public names)
    DEFAULT_COMPLETION_WINDOW, META_KEY, batch_metadata, batch_object, check_metadata, expire_due_batches,
    expire_if_due, expires_at, openai_status, parse_completion_window,
)
from weir.jobs.openai_batch.requests import (  # noqa: F401
    CHAT_COMPLETIONS, CLASSIFICATIONS, COMPLETIONS, ENDPOINTS, NO_REQUEST, BatchFile, BatchFileError,
    parse_batch_file, to_request,
)
from weir.jobs.openai_batch.results import (  # noqa: F401
    error_file_path, is_error, response_body, result_line, top_entries,
)
