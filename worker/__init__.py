"""The Celery worker: the only place that joins the queue, the engine and the results database.

``weir.worker.app`` holds the Celery app, ``weir.worker.tasks`` the tasks (thin adapters), ``weir.worker.runtime``
the engine and database handles one worker process shares across its task threads.
"""
