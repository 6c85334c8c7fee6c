"""The seams where applications (catalog enrichment, OpenAI batch files) meet the queue core.

The core knows a request in and a result out; an application adds its own behaviour through
entry points its package declares (``[project.entry-points."<group>"]`` in ``pyproject.toml``),
so the core imports no application, as Celery finds its extensions and pytest its plugins:

- :data:`COMMANDS`: a function adding the application's ``weir`` subcommands
  (:func:`weir.cli.build_parser`);
- :data:`RESULT_PROJECTIONS`: a :class:`ResultProjection`, called by the group commit inside the
  transaction that stores results (the catalog's ``product_enrichment`` rows);
- :data:`POST_RUN_POLICIES`: a :class:`PostRunPolicy`, asked by the worker once a generation has
  run whether to run it once more (the catalog's description retry);
- :data:`SWEEP_RULES`: a :class:`SweepRule`, run by every sweep (OpenAI batch expiry);
- :data:`TASKS`: a module of Celery tasks the worker imports (the catalog's nightly task);
- :data:`BEAT_SCHEDULES`: a function of the settings returning entries of Celery's
  ``beat_schedule`` (the catalog's nightly run);
- :data:`TABLES`: a module defining the application's tables on :class:`weir.jobs.db.Base` (the
  catalog's ``product_enrichment``), imported by :func:`load_tables` so that the migrations and
  their check see one metadata;
- :data:`RESULT_ANNOTATIONS`: a :class:`ResultAnnotation`, asked what the application says about
  one result row as :meth:`weir.jobs.client.Client.results` gives it (the catalog's decision on
  the field an enrichment job fills), shown under the row's ``annotations``;
- :data:`REQUEST_EXTENSIONS`: a pydantic model of the data an application keeps with a job under
  its name in the request's ``extensions`` (the catalog's :class:`~weir.jobs.catalog.marker.Enrichment`),
  checked when the request is (:class:`RequestExtension`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from importlib.metadata import entry_points
from typing import Any, Optional, Protocol, Sequence

logger = logging.getLogger(__name__)

COMMANDS = "weir.commands"
RESULT_PROJECTIONS = "weir.result_projections"
POST_RUN_POLICIES = "weir.post_run_policies"
SWEEP_RULES = "weir.sweep_rules"
TASKS = "weir.tasks"
BEAT_SCHEDULES = "weir.beat_schedules"
TABLES = "weir.tables"
REQUEST_EXTENSIONS = "weir.request_extensions"
RESULT_ANNOTATIONS = "weir.result_annotations"


class ResultProjection(Protocol):
    """Writes an application's own rows from stored results."""

    def __call__(self, session: Any, results: Sequence[tuple[Any, Any]], *, model: str) -> None:
        """Project ``results`` (``(Job, JobResult)`` pairs, each just stored as the job's
        outcome) into the application's tables inside ``session`` (the results' transaction:
        both commit or neither). ``model`` is the worker's model name."""


class ResultAnnotation(Protocol):
    """What an application says about a job's result, for whoever reads results."""

    def __call__(self, row: dict[str, Any]) -> Optional[Any]:
        """A JSON-serialisable value about ``row`` (a dict of
        :meth:`weir.jobs.client.Client.results`, without ``annotations``), or None when the row
        is none of the application's business. Pure: no database, no model."""


class PostRunPolicy(Protocol):
    """Decides whether a finished generation runs once more, and which of the runs is kept."""

    def retry_params(self, request: Any, output: Any) -> Optional[Any]:
        """The ``SamplingParams`` of one more run of ``request`` (a ``GenerateRequest``) after
        ``output`` (its ``RequestOutput``), or None when the output stands."""

    def pick(self, request: Any, outputs: list[Any]) -> int:
        """The index of the run to keep among ``outputs`` (the first run's, then the retry's)."""


class RequestExtension(Protocol):
    """A pydantic model of an application's data kept with a job (``request.extensions[name]``)."""

    def check_request(self, request: Any) -> None:
        """Refuse (``ValueError`` naming the field) an extension that does not fit the request it
        rides on (``request``: the whole ``ClassifyRequest``/``GenerateRequest``)."""

    def sampling_attempts(self) -> dict[str, dict[str, Any]]:
        """Sampling fields of further runs the application may ask for (its post-run policy), by
        the field that holds them, so the producer checks that each attempt fits the model."""


class SweepRule(Protocol):
    """A periodic rule, run by every sweep in a transaction of its own."""

    def __call__(self, session: Any, *, model: str, now: datetime) -> int:
        """Apply the rule to the model's rows as of ``now`` (timezone-aware UTC) inside
        ``session`` (the caller commits, and runs the call again on a deadlock or serialization
        failure); return how many things it changed (batches expired, ...), for the log."""


def load(group: str) -> dict[str, Any]:
    """The objects registered under entry-point ``group``, by entry-point name (sorted), each
    loaded (imported) on this call.

    Raises:
        ImportError, AttributeError: an entry point names what cannot be imported (an
            application installed half-way): a worker refuses to start rather than run without it.
    """
    return {ep.name: ep.load() for ep in sorted(entry_points(group=group), key=lambda ep: ep.name)}


def load_each(group: str) -> dict[str, Any]:
    """:func:`load`, leaving out (and logging) an entry point that cannot be loaded: for seams
    where one broken application must not stop the others (commands, sweep rules)."""
    found = {}
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        try:
            found[ep.name] = ep.load()
        except Exception:
            logger.exception("%s entry point %s (%s) cannot be loaded", group, ep.name, ep.value)
    return found


def load_tables() -> None:
    """Import every application's table module (:data:`TABLES`), so that
    :class:`weir.jobs.db.Base`'s metadata holds their tables too."""
    load(TABLES)


def task_modules() -> list[str]:
    """The modules of the applications' Celery tasks (:data:`TASKS`), by name, for Celery's
    ``include`` (imported when a worker starts, not here)."""
    return [ep.value for ep in sorted(entry_points(group=TASKS), key=lambda ep: ep.name)]
