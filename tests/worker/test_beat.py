import pytest
from celery.schedules import crontab

from jobs import names
from weir.config import EngineSettings, Settings, WorkerSettings
from worker.beat import NIGHTLY_ENRICHMENT, beat_schedule, cron


def test_no_catalog_no_schedule():
    assert beat_schedule(Settings(worker=WorkerSettings(catalog_path=None))) == {}


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
