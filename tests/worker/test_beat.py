import pytest
from celery.schedules import crontab

from weir.jobs import names
from weir.config import EngineSettings, Settings, WorkerSettings
from weir.jobs.catalog.nightly import NIGHTLY_ENRICHMENT
from weir.worker.beat import SWEEP, beat_schedule, cron


def test_without_a_catalog_only_the_sweeper_runs():
    settings = Settings(engine=EngineSettings(model=""),
                        worker=WorkerSettings(catalog_path=None, queue=None, sweep_interval_s=120))
    assert beat_schedule(settings) == {
        SWEEP: {"task": names.SWEEP, "schedule": 120.0,
                "options": {"queue": "weir.SmolLM2-135M-Instruct.control", "expires": 120.0}}
    }


def test_nightly_enrichment_entry():
    settings = Settings(
        engine=EngineSettings(model=""),
        worker=WorkerSettings(catalog_path="/data/catalog.csv", catalog_schedule="30 1 * * *", queue=None),
    )
    entry = beat_schedule(settings)[NIGHTLY_ENRICHMENT]
    assert entry["task"] == names.ENRICH_CATALOG
    assert entry["args"] == ("/data/catalog.csv",)
    assert entry["kwargs"] == {"spec": None}
    with_spec = Settings(engine=EngineSettings(model=""),
                         worker=WorkerSettings(catalog_path="/data/catalog.csv", catalog_spec="flipkart"))
    assert beat_schedule(with_spec)[NIGHTLY_ENRICHMENT]["kwargs"] == {"spec": "flipkart"}
    assert entry["options"] == {"queue": "weir.SmolLM2-135M-Instruct.control", "expires": 3600}
    assert entry["schedule"] == crontab(minute="30", hour="1")


def test_cron_needs_five_fields():
    with pytest.raises(ValueError, match="5 fields"):
        cron("0 2 * *")


def test_the_nightly_slot_is_the_latest_firing_at_or_before_now():
    from datetime import datetime, timezone

    from weir.jobs.catalog.nightly import nightly_key, schedule_slot

    at = datetime(2026, 12, 1, 8, 3, 59, tzinfo=timezone.utc)  # a Tuesday
    assert schedule_slot("0 2 * * *", at) == datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)
    assert schedule_slot("30 1 * * 1", at) == datetime(2026, 11, 30, 1, 30, tzinfo=timezone.utc)
    assert schedule_slot("3 8 * * *", at) == datetime(2026, 12, 1, 8, 3, tzinfo=timezone.utc)
    assert nightly_key("/data/c.csv", "2026-12-01T02:00:00+00:00") == "catalog:/data/c.csv@2026-12-01T02:00:00+00:00"
