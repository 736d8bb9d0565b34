"""Prometheus series the submit pipeline records: admissions, refusals, degradation steps, cache
hits, idempotent replays, abandoned requests, the local floor. The web tier exposes them at
/metrics (``web/metrics.py``).

Under gunicorn (``sluice web``) every web process writes its series into one multiprocess
directory, so a scrape answered by any of them shows the sum of all (``core/observe/metrics.py``);
the series other processes export are listed there.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ADMITTED = Counter("sluice_admission_admitted_total", "Requests admitted, by the limiter that admitted them.",
                   ["limiter"])
REJECTIONS = Counter("sluice_admission_rejections_total", "Requests rejected at admission, by gate and reason.",
                     ["gate", "reason"])
IDEMPOTENT_REPLAYS = Counter("sluice_idempotent_replays_total",
                             "Submits answered with the request an earlier submit with the same key created.")
CACHE_HITS = Counter("sluice_cache_hits_total", "Submits answered from the hot answer cache, no GPU used.")
ABANDONED = Counter("sluice_requests_abandoned_total",
                    "Requests cancelled because their client left: closed a wait or a stream, or stopped polling.",
                    ["how"])
DEGRADED = Counter("sluice_degradation_steps_total", "Requests a degradation step changed at admission, by step.",
                   ["step"])
# Under gunicorn: 1 while any web process admits on its local floor.
LOCAL_FLOOR = Gauge("sluice_admission_local_floor", "1 while this process admits on its local floor (Redis away).",
                    multiprocess_mode="max")
