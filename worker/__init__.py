"""The Celery worker: the only place that joins the queue, the engine and the results database.

``worker.app`` holds the Celery app, ``worker.tasks`` the tasks (thin adapters), ``worker.runtime``
the engine and database handles one worker process shares across its task threads.
"""
