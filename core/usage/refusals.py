"""Refusals in the usage report: a refused request has no row, so the admission script itself
counts each one it refuses (``admit.lua``, no extra round trip: a refusal under a spike must stay
cheap) in a hash per day (field: tenant, key, model, priority, service tier, source and reason), and the sweep
copies the last days' totals into ``usage_outcomes`` (``kind = 'refusal'``). The copy sets each
count to Redis's total rather than adding to it, so copying twice changes nothing.

Refusals on a web process's local floor (Redis away) go uncounted.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime

import redis
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from models import Tenant, UsageOutcome
from models.session import Database
from models.usage import NO_KEY

log = logging.getLogger(__name__)

PREFIX = "sluice:usage:refusals:"
KEEP_S = 4 * 86400
FLUSH_DAYS = 2  # today and yesterday: the sweep may be down a day without a loss
DAY_S = 86400


def day_key(at: float) -> str:
    return f"{PREFIX}{int(at // DAY_S) * DAY_S}"


def field(tenant_id: uuid.UUID, key_id: uuid.UUID | None, model: str, priority: str, source: str,
          tier: str) -> str:
    """A refusal's field in the day's hash, but for its reason (which the script appends)."""
    return "|".join((str(tenant_id), str(key_id or NO_KEY), model, priority, source, tier, ""))


def flush(db: Database, client: redis.Redis, now: float | None = None) -> int:
    """Copy the last FLUSH_DAYS days' refusal counts into usage_outcomes; how many groups."""
    now = time.time() if now is None else now
    rows = []
    for back in range(FLUSH_DAYS):
        start = int(now // DAY_S) * DAY_S - back * DAY_S
        for field, n in client.hgetall(f"{PREFIX}{start}").items():
            parts = (field.decode() if isinstance(field, bytes) else field).split("|")
            if len(parts) == 6:  # counted before tiers: its class's plain tier
                parts.insert(5, "batch" if parts[3] == "batch" else "default")
            if len(parts) != 7:
                continue
            tenant, key, model, priority, source, tier, reason = parts
            rows.append({"day": datetime.fromtimestamp(start, UTC), "tenant_id": uuid.UUID(tenant),
                         "api_key_id": uuid.UUID(key), "model": model, "priority": priority, "service_tier": tier,
                         "source": source, "kind": "refusal", "code": reason, "count": int(n)})
    if rows:  # a tenant deleted since has nothing to count
        with db.session() as session:
            alive = set(session.scalars(select(Tenant.id).where(Tenant.id.in_({r["tenant_id"] for r in rows}))))
        rows = [r for r in rows if r["tenant_id"] in alive]
    if not rows:
        return 0
    rows.sort(key=lambda r: (r["day"], str(r["tenant_id"]), str(r["api_key_id"]), r["model"], r["priority"],
                             r["service_tier"], r["source"], r["code"]))
    statement = insert(UsageOutcome).values(rows)
    with db.session() as session:
        session.execute(statement.on_conflict_do_update(
            index_elements=["day", "tenant_id", "api_key_id", "model", "priority", "service_tier", "source", "kind",
                            "code"],
            set_={"count": statement.excluded.count}))
    return len(rows)
