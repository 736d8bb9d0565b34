"""The broker side: queue names, worker roles, task names, publishing a request, the Celery
configuration every process shares."""
