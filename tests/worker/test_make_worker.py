"""``weir worker`` and the embedded mode build their Celery worker with one function."""

from celery.apps.worker import Worker
from celery.worker import WorkController

from weir.config import EngineSettings, Settings, WorkerSettings
from weir.worker.app import BulkLane, InteractiveLane, make_app, make_worker, model_queue, worker_concurrency


def _settings(**worker) -> Settings:
    return Settings(engine=EngineSettings(model="/m/Tiny.Q4_0.gguf", max_num_seqs=6), worker=WorkerSettings(**worker))


def test_queue_and_concurrency_come_from_the_settings():
    assert (model_queue(_settings()), worker_concurrency(_settings())) == ("weir.Tiny", 6)
    assert (model_queue(_settings(queue="q")), worker_concurrency(_settings(concurrency=2))) == ("q", 2)


def _lane(worker, kind):
    return next(step for step in worker.consumer.blueprint.steps.values() if isinstance(step, kind))


def test_each_lane_has_its_prefetch_window_and_a_thread_per_message_of_each():
    settings = _settings(concurrency=3, interactive_concurrency=2)
    worker = make_worker(make_app(settings), settings, hostname="weir-1@host", loglevel="INFO")
    assert worker.concurrency == 3 + 2 + 1
    assert worker.consumer.initial_prefetch_count == 3  # the model queue's window; Celery would give 6
    lane = _lane(worker, InteractiveLane)
    assert (lane.enabled, lane.queue_name, lane.prefetch) == (True, "weir.Tiny.interactive", 2)
    lane = _lane(worker, BulkLane)  # one chunk: half of 3 threads, rounded down
    assert (lane.enabled, lane.queue_name, lane.prefetch) == (True, "weir.Tiny.bulk", 1)


def test_the_bulk_window_holds_the_chunks_that_fill_the_engine_and_one_more():
    def bulk_window(max_num_seqs, chunk_size, concurrency=None):
        settings = Settings(engine=EngineSettings(model="/m/Tiny.Q4_0.gguf", max_num_seqs=max_num_seqs),
                            worker=WorkerSettings(bulk_chunk_size=chunk_size, concurrency=concurrency))
        return _lane(make_worker(make_app(settings), settings, hostname="w@h", loglevel="INFO"), BulkLane).prefetch

    # 2 requests per sequence in the engine: 2 * 64 = 128 places, one chunk of 256 fills them
    assert bulk_window(64, 256) == 2
    assert bulk_window(256, 256) == 3  # 512 places: two chunks, and one more
    assert bulk_window(64, 16) == 9  # 128 places: eight chunks, and one more
    assert bulk_window(64, 16, concurrency=8) == 4  # never more than half the model queue's threads


def _consumed(worker) -> list[str]:
    return sorted(worker.app.amqp.queues.consume_from)


def test_the_command_line_worker():
    settings = _settings(concurrency=3)
    worker = make_worker(make_app(settings), settings, hostname="weir-1@host", loglevel="INFO")
    assert isinstance(worker, Worker)
    assert (worker.hostname, worker.concurrency, worker.pool_cls.__module__) == (
        "weir-1@host", 3 + 6 + 1, "celery.concurrency.thread")  # + the interactive and bulk lanes' threads
    assert _consumed(worker) == ["weir.Tiny", "weir.Tiny.control"]


def test_the_embedded_worker_is_the_same_without_signal_handlers():
    settings = _settings(concurrency=3)
    ready = []
    worker = make_worker(make_app(settings), settings, hostname="embedded@host", loglevel="WARNING",
                         embedded=True, ready_callback=ready.append)
    assert type(worker) is WorkController
    assert (worker.hostname, worker.concurrency, worker.pool_cls.__module__) == (
        "embedded@host", 3 + 6 + 1, "celery.concurrency.thread")
    assert _consumed(worker) == ["weir.Tiny", "weir.Tiny.control"]
    assert worker.ready_callback == ready.append


def test_task_events_are_on_and_task_sent_events_follow_the_setting():
    conf = make_app(_settings()).conf
    assert (conf.worker_send_task_events, conf.task_send_sent_event) == (True, False)
    assert make_app(_settings(task_send_sent_event=True)).conf.task_send_sent_event is True
