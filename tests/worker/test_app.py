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
    assert options(20)["unacked_restore_interval"] == 5
    assert options(2)["unacked_restore_interval"] == 1


def test_the_delivery_settings_a_worker_runs_with():
    """What at-least-once delivery rests on, as the tasks see it: each job task acks late (after
    its outcome is stored), one message is reserved per thread, messages are JSON, and Redis'
    visibility timeout (the redelivery of a dead worker's messages) is the configured one, longer
    than a lease, so a redelivery of a running job finds its lease live."""
    import weir.worker.tasks  # noqa: F401  (registers the tasks)
    from weir.jobs import names
    from weir.worker.app import EMBEDDED_BROKER_URL, app, make_app

    settings = Settings(worker=WorkerSettings(visibility_timeout_s=900, lease_s=20))
    conf = make_app(settings).conf
    assert (conf.task_acks_late, conf.worker_prefetch_multiplier, conf.task_serializer, conf.accept_content) == (
        True, 1, "json", ["json"])
    assert conf.broker_transport_options["visibility_timeout"] == 900 > settings.worker.lease_s
    for name in (names.RUN_JOB, names.RUN_CHUNK):  # a task option would override the app's
        assert app.tasks[name].acks_late is True
    assert WorkerSettings().visibility_timeout_s > WorkerSettings().lease_s
    # a worker started before its broker answers, or one that loses it, waits and retries for ever
    assert (conf.broker_connection_retry_on_startup, conf.broker_connection_max_retries) == (True, None)
    # on Redis, the transport that keeps an unreadable list entry as a dead letter instead of dying
    on_redis = make_app(Settings(worker=WorkerSettings(broker_url="redis://127.0.0.1:6379/0"))).conf
    assert (on_redis.broker_url, on_redis.broker_transport) == ("redis://127.0.0.1:6379/0",
                                                               "weir.worker.transport:Transport")
    assert (conf.broker_url, conf.broker_transport) == (EMBEDDED_BROKER_URL, None)  # no broker: the embedded one
