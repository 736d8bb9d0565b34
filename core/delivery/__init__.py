"""Getting answers to clients: waits, token streams, move announcements and webhooks (what a
webhook may be is checked below, in ``core/hooks.py``)."""
