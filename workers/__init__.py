"""Celery app, tasks, engine runtime and engines. Importing this package starts nothing."""
