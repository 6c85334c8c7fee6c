"""Periodic work: the sweeper and the applications' periodic tasks (run ``weir worker --beat`` or
``celery beat``)."""

from __future__ import annotations

from celery.schedules import crontab

from weir.jobs import names
from weir.config import Settings

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
    """Celery's ``beat_schedule``: the sweeper, and the applications' entries
    (:data:`weir.jobs.applications.BEAT_SCHEDULES`: the catalog's nightly enrichment when
    ``WEIR_CATALOG_PATH`` is set).

    The sweeper (:data:`weir.jobs.names.SWEEP`) runs every ``WEIR_SWEEP_INTERVAL_S`` seconds and
    publishes again the jobs whose message may be lost. It goes to the model's control queue
    (:func:`weir.jobs.names.control_queue`), so it never waits behind its backlog, and expires
    after one interval unconsumed, so a beat with no worker does not pile sweeps up.
    """
    from weir.jobs import applications

    queue = control_queue(settings)
    options = {"queue": queue, "expires": settings.worker.sweep_interval_s}
    schedule = {
        SWEEP: {"task": names.SWEEP, "schedule": settings.worker.sweep_interval_s, "options": options}
    }
    for entries in applications.load(applications.BEAT_SCHEDULES).values():
        schedule.update(entries(settings))
    return schedule


def control_queue(settings: Settings) -> str:
    """The model's control queue, where periodic tasks go (:func:`weir.jobs.names.control_queue`)."""
    return names.control_queue(names.queue_for_model(settings.engine.model, settings.worker.queue))
