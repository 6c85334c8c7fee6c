"""Periodic work: the sweeper and the nightly catalog enrichment (run ``weir worker --beat`` or
``celery beat``)."""

from __future__ import annotations

from celery.schedules import crontab

from jobs import names
from weir.config import Settings

NIGHTLY_ENRICHMENT = "enrich-catalog-nightly"
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
    ``WEIR_CATALOG_PATH`` is set.

    The sweeper (:data:`jobs.names.SWEEP`) runs every ``WEIR_SWEEP_INTERVAL_S`` seconds and
    publishes again the jobs whose message may be lost. The nightly entry publishes
    :data:`jobs.names.ENRICH_CATALOG` at ``WEIR_CATALOG_SCHEDULE`` (cron, UTC); the task only
    enqueues the batch, the same workers run it. Both go to the model's queue.
    """
    options = {"queue": names.queue_for_model(settings.engine.model, settings.worker.queue)}
    schedule = {
        SWEEP: {"task": names.SWEEP, "schedule": settings.worker.sweep_interval_s, "options": options}
    }
    if settings.worker.catalog_path:
        schedule[NIGHTLY_ENRICHMENT] = {
            "task": names.ENRICH_CATALOG,
            "schedule": cron(settings.worker.catalog_schedule),
            "args": (settings.worker.catalog_path,),
            "options": options,
        }
    return schedule
