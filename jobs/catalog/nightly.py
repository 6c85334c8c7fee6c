"""The catalog's nightly run: the beat entry that enqueues a catalog's enrichment batch on a cron
schedule (``WEIR_CATALOG_PATH``, ``WEIR_CATALOG_SCHEDULE``, ``WEIR_CATALOG_SPEC``) and the task
that does it, once per catalog and slot. Registered with the worker under the ``weir.tasks`` and
``weir.beat_schedules`` entry-point groups (:mod:`weir.jobs.applications`)."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta, timezone

from celery import shared_task
from weir.config import Settings, get_settings
from weir.jobs import names
from weir.worker.beat import control_queue, cron

logger = logging.getLogger(__name__)

NIGHTLY_ENRICHMENT = "enrich-catalog-nightly"
NIGHTLY_EXPIRES_S = 3600
MAX_SLOT_SEARCH_MINUTES = 366 * 24 * 60


def beat_entries(settings: Settings) -> dict:
    """The nightly entry of Celery's ``beat_schedule`` when ``WEIR_CATALOG_PATH`` is set (none
    otherwise): :data:`weir.jobs.names.ENRICH_CATALOG` at ``WEIR_CATALOG_SCHEDULE`` (cron, UTC),
    with the job spec ``WEIR_CATALOG_SPEC`` (default: the default spec). The task only enqueues the
    batch, the same workers run it. It goes to the model's control queue and expires after an hour
    unconsumed, so a beat with no worker does not pile nights up."""
    if not settings.worker.catalog_path:
        return {}
    return {NIGHTLY_ENRICHMENT: {
        "task": names.ENRICH_CATALOG,
        "schedule": cron(settings.worker.catalog_schedule),
        "args": (settings.worker.catalog_path,),
        "kwargs": {"spec": settings.worker.catalog_spec},
        "options": {"queue": control_queue(settings), "expires": NIGHTLY_EXPIRES_S},
    }}


def schedule_slot(line: str, at: datetime) -> datetime:
    """The latest time at or before ``at`` (to the minute, UTC) that the cron ``line`` fires.

    Raises:
        ValueError: the line is not valid (see :func:`cron`), or it never fired in the year
            before ``at``.
    """
    schedule = cron(line)
    t = at.astimezone(timezone.utc).replace(second=0, microsecond=0)
    for _ in range(MAX_SLOT_SEARCH_MINUTES):
        if (t.minute in schedule.minute and t.hour in schedule.hour and t.day in schedule.day_of_month
                and t.month in schedule.month_of_year and t.isoweekday() % 7 in schedule.day_of_week):
            return t
        t -= timedelta(minutes=1)
    raise ValueError(f"cron line {line!r} did not fire in the year before {at.isoformat()}")


def nightly_key(catalog_path: str, slot: str) -> str:
    """The idempotency key of a catalog's nightly batch: its absolute path and the slot."""
    return f"catalog:{os.path.abspath(catalog_path)}@{slot}"


@shared_task(name=names.ENRICH_CATALOG)  # bound to the worker's app (a module of weir.tasks)
def enrich_catalog(catalog_path: str, slot: str | None = None, spec: str | None = None) -> None:
    """Enqueue the enrichment batch of the catalog at ``catalog_path``, read and prompted as the
    job spec ``spec`` says (a TOML file or a shipped spec's name; None: the default spec), for one
    scheduled slot (the nightly beat entry). Incremental: only the products that are new, changed
    or not fully enriched yet (:func:`weir.jobs.catalog.plan_enrichment`) are enqueued. One batch per catalog and slot, whatever beats or redeliveries
    happen: the batch's idempotency key is the catalog's absolute path and the slot, the latest
    ``WEIR_CATALOG_SCHEDULE`` time at or before the task's start (or ``slot``, an ISO time). The
    task runs on the control queue, so it starts within seconds of the beat, not behind a backlog.
    """
    from weir.jobs.catalog.enrichment import enqueue_catalog, plan_enrichment, read_catalog
    from weir.jobs.client import Client
    from weir.jobs.db import utcnow
    from weir.jobs.catalog.spec import load_spec

    settings = get_settings()
    if slot is None:
        slot = schedule_slot(settings.worker.catalog_schedule, utcnow()).isoformat()
    key = nightly_key(catalog_path, slot)
    catalog = read_catalog(catalog_path, load_spec(spec))
    client = Client(settings)
    try:
        plan = plan_enrichment(client.session_factory, catalog, client.model)
        batch_id = enqueue_catalog(client, catalog, idempotency_key=key, plan=plan)
    finally:
        client.close()
    logger.info("catalog %s (spec %s), slot %s: enrichment batch %s (%d new, %d changed, %d unfinished, "
                "%d unchanged products)", catalog_path, spec or "default", slot,
                batch_id or "none, nothing to enrich", plan.num_new, plan.num_changed, plan.num_unfinished,
                plan.num_unchanged)
