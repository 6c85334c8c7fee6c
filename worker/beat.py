"""Periodic work: the sweeper and the nightly catalog enrichment (run ``weir worker --beat`` or
``celery beat``)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from celery.schedules import crontab

from weir.jobs import names
from weir.config import Settings

NIGHTLY_ENRICHMENT = "enrich-catalog-nightly"
NIGHTLY_EXPIRES_S = 3600
MAX_SLOT_SEARCH_MINUTES = 366 * 24 * 60
SWEEP = "sweep-lost-jobs"


def cron(line: str) -> crontab:
    """A Celery ``crontab`` from a five-field cron line ``minute hour day-of-month month day-of-week``.

    Raises:
        ValueError: the line does not have five fields, or a field is not valid cron syntax.
    """
    fields = line.split()
    if len(fields) != 5:
        raise ValueError(f"cron line needs 5 fields (minute hour day month weekday), got {line!r}")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return crontab(
        minute=minute,
        hour=hour,
        day_of_month=day_of_month,
        month_of_year=month_of_year,
        day_of_week=day_of_week,
    )


def beat_schedule(settings: Settings) -> dict:
    """Celery's ``beat_schedule``: the sweeper, and the nightly enrichment when
    ``WEIR_CATALOG_PATH`` is set (with the job spec ``WEIR_CATALOG_SPEC``, default the default spec).

    The sweeper (:data:`weir.jobs.names.SWEEP`) runs every ``WEIR_SWEEP_INTERVAL_S`` seconds and
    publishes again the jobs whose message may be lost. The nightly entry publishes
    :data:`weir.jobs.names.ENRICH_CATALOG` at ``WEIR_CATALOG_SCHEDULE`` (cron, UTC); the task only
    enqueues the batch, the same workers run it. Both go to the model's control queue
    (:func:`weir.jobs.names.control_queue`), so they never wait behind its backlog; they expire after
    one interval (a sweep) or one hour (the nightly run) unconsumed, so a beat with no worker
    does not pile them up.
    """
    queue = names.control_queue(names.queue_for_model(settings.engine.model, settings.worker.queue))
    options = {"queue": queue, "expires": settings.worker.sweep_interval_s}
    schedule = {
        SWEEP: {"task": names.SWEEP, "schedule": settings.worker.sweep_interval_s, "options": options}
    }
    if settings.worker.catalog_path:
        schedule[NIGHTLY_ENRICHMENT] = {
            "task": names.ENRICH_CATALOG,
            "schedule": cron(settings.worker.catalog_schedule),
            "args": (settings.worker.catalog_path,),
            "kwargs": {"spec": settings.worker.catalog_spec},
            "options": {"queue": queue, "expires": NIGHTLY_EXPIRES_S},
        }
    return schedule


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
