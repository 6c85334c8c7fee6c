"""The Celery app's delivery settings: the time limits nest, and Redis looks for expired messages
often enough for the visibility timeout in use."""

from weir.config import Settings, WorkerSettings
from weir.worker.app import transport_options


def test_default_limits_are_consistent():
    assert WorkerSettings().delivery_problems() == []


def test_a_visibility_timeout_shorter_than_one_delivery_is_named():
    settings = WorkerSettings(visibility_timeout_s=4, job_timeout_s=1, db_retry_timeout_s=2)
    assert settings.delivery_problems() == [
        "WEIR_VISIBILITY_TIMEOUT_S=4 is not above 2 * WEIR_JOB_TIMEOUT_S + WEIR_DB_RETRY_TIMEOUT_S = 4: "
        "Redis will deliver slow jobs a second time while they still run"
    ]


def test_a_lease_shorter_than_two_renewals_is_named():
    settings = WorkerSettings(lease_s=4, cancel_poll_interval_s=2)
    assert settings.delivery_problems() == [
        "WEIR_LEASE_S=4 is not above 2 * WEIR_CANCEL_POLL_INTERVAL_S = 4: "
        "leases of running jobs would expire between renewals"
    ]
    assert WorkerSettings().sweep_deadline_s == 60
    assert WorkerSettings(sweep_after_s=5).sweep_deadline_s == 5


def test_expired_messages_are_looked_for_every_quarter_visibility_timeout_at_most_10_s():
    def options(visibility_timeout_s):
        return transport_options(Settings(worker=WorkerSettings(visibility_timeout_s=visibility_timeout_s)))

    assert options(3600) == {"visibility_timeout": 3600, "unacked_restore_interval": 10,
                             "unacked_restore_throttle": 1, "unacked_key": "weir.SmolLM2-135M-Instruct.unacked",
                             "unacked_index_key": "weir.SmolLM2-135M-Instruct.unacked_index",
                             "unacked_mutex_key": "weir.SmolLM2-135M-Instruct.unacked_mutex"}
    assert options(8)["unacked_restore_interval"] == 2
    assert options(2)["unacked_restore_interval"] == 1
