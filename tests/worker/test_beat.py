import pytest
from celery.schedules import crontab

from jobs import names
from weir.config import EngineSettings, Settings, WorkerSettings
from worker.beat import NIGHTLY_ENRICHMENT, SWEEP, beat_schedule, cron


def test_without_a_catalog_only_the_sweeper_runs():
    settings = Settings(engine=EngineSettings(model=""),
                        worker=WorkerSettings(catalog_path=None, queue=None, sweep_interval_s=120))
    assert beat_schedule(settings) == {
        SWEEP: {"task": names.SWEEP, "schedule": 120.0, "options": {"queue": "weir.SmolLM2-135M-Instruct"}}
    }


def test_nightly_enrichment_entry():
    settings = Settings(
        engine=EngineSettings(model=""),
        worker=WorkerSettings(catalog_path="/data/catalog.csv", catalog_schedule="30 1 * * *", queue=None),
    )
    entry = beat_schedule(settings)[NIGHTLY_ENRICHMENT]
    assert entry["task"] == names.ENRICH_CATALOG
    assert entry["args"] == ("/data/catalog.csv",)
    assert entry["options"] == {"queue": "weir.SmolLM2-135M-Instruct"}
    assert entry["schedule"] == crontab(minute="30", hour="1")


def test_cron_needs_five_fields():
    with pytest.raises(ValueError, match="5 fields"):
        cron("0 2 * *")
