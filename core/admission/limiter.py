"""The shared admission limiter: token buckets and in-flight sets in Redis, changed only by Lua.

Why a script and not the ``limits`` library: ``limits`` (5.x) checks one limit per call, so a
request that passes the token limit and fails the request limit has already been charged for
tokens; it has no way to give tokens back, so reserved ``max_tokens`` could never be reconciled
with actual use; its exact moving window stores one list entry per unit of cost (a million-token
budget is a million-entry list); and it has no notion of requests in flight. ``admit.lua``
checks every limit of the global and tenant gates and charges all of them or none in one
EVALSHA; ``release.lua`` refunds unused tokens and frees the concurrency slot exactly once.

Used through ``core/admission/gates.py`` (admit, peek, and the release every terminal transition
triggers as a lifecycle hook, in whichever process made it) and by the sweep (reconcile).
Callers pass their own Redis client, with the timeout they can afford.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
from sqlalchemy import select

from core.admission.load import LoadLevel, capacity_key, class_name, counters_key, room_key, snapshot_key
from core.broker.fair import LINE_LUA, RESERVED_KEY, class_queues, seconds_key
from core.ids import is_uuid
from core.rediskeys import (
    INFLIGHT_SUFFIX,
    LOAD_LEVEL_KEY,
    PLATFORM_BUCKET_KEY,
    TENANT_LIMIT_PREFIX,
    inflight_key,
    tenant_bucket_key,
)
from core.tenants.tiers import Limits
from core.usage import refusals
from core.usage.budgets import CHARGES_KEY as BUDGET_CHARGES_KEY
from core.usage.budgets import used_units
from models import InferenceRequest
from models.session import Database

log = logging.getLogger(__name__)

_LUA = Path(__file__).with_name("lua")


@dataclass(frozen=True)
class Quota:
    """One limit as OpenAI-style headers report it."""

    limit: int
    remaining: int
    reset_ms: int  # until the bucket is full again


@dataclass(frozen=True)
class Verdict:
    gate: str  # "" when admitted, else "global" | "tenant" | "request"
    reason: str  # shed, batch_paused, platform_tokens, tokens_per_minute, requests_per_minute, ...
    retry_after_ms: int  # when the failing bucket will hold enough; 0 when unknown
    tokens: Quota
    requests: Quota
    load_level: int
    wait_ms: int = -1  # the class's estimated queue wait; -1 when no fresh figure stands
    finish_ms: int = -1  # that wait plus the request's own output at the engines' speed; -1: unknown
    basis: str = ""  # what the estimate stood on: "monitor", "workers" (the monitor away) or ""
    budget: int = 0  # gate "budget": the index (1-based) of the hard budget that refused it
    budget_spent: int = 0  # that budget's counter when it refused (its units)

    @property
    def admitted(self) -> bool:
        return self.gate == ""

    @property
    def run_ms(self) -> int:
        """The request's own part of ``finish_ms``: its prefill and output at the engines' speed,
        the wait apart; -1 where either estimate is unknown."""
        return self.finish_ms - self.wait_ms if self.finish_ms >= 0 and self.wait_ms >= 0 else -1


def unused_tokens(reserved: int, input_tokens: int, output_tokens: int | None, started: bool) -> int:
    """Tokens to give back when a request ends: all of them if it never ran, else reserved - used.

    Negative when the engine counted more input tokens than admission estimated: the tenant pays.
    """
    return reserved - (input_tokens + (output_tokens or 0)) if started else reserved


class SharedLimiter:
    def __init__(self, client: redis.Redis, *, platform_tokens_per_minute: int = 0,
                 load_level_max_age_s: float = 30.0, reject_batch: bool = True, shed: bool = True,
                 tight_promise_factor: float | None = None, promise_factor: float = 1.0,
                 capacity_max_age_s: float = 0.0) -> None:
        self.redis = client
        self.platform_tokens_per_minute = platform_tokens_per_minute
        self.load_level_max_age_ms = int(load_level_max_age_s * 1000)
        # The levels at which the gate refuses batch work / everything; a switched-off step never comes.
        self.reject_batch_level = int(LoadLevel.REJECT_BATCH) if reject_batch else 99
        self.shed_level = int(LoadLevel.SHED) if shed else 99
        # From the tight_promise level on, a request must be predicted to finish within this
        # fraction of its deadline; None: the step is off and the promise keeps no margin.
        self.tight_level = int(LoadLevel.TIGHT_PROMISE) if tight_promise_factor is not None else 99
        self.tight_factor = tight_promise_factor or 1.0
        # At every level, the share of its deadline a request must be predicted to finish in.
        self.promise_factor = promise_factor
        # While the monitor is away, a worker's capacity entry counts for this long after its
        # heartbeat wrote it (admission passes the patience ``live_workers`` has; 0: never).
        self.capacity_max_age_ms = int(capacity_max_age_s * 1000)
        # admit.lua reads the fair lines with their weight() (core/broker/lua/line.lua).
        self._admit = client.register_script(LINE_LUA + _script("admit.lua"))
        self._release = client.register_script(_script("release.lua"))

    def admit(self, request_id: str, tenant_id: str, limits: Limits, cost: int, priority: str, *,
              too_large: bool = False, dry_run: bool = False, now_ms: int | None = None,
              model: str = "", deadline_s: float = float("inf"), max_tokens: int = 0,
              input_tokens: int = 0, spent_s: float = 0.0, charge: str = "full",
              budgets: Sequence[tuple[str, int, int]] = (), budget_record: str = "",
              count: str = "", refusal_field: str = "", place: str = "", held_share: float = 0.0,
              queue: str = "", tier: str = "") -> Verdict:
        """Run the gates for one request; when it passes, charge every limit and count it in flight.

        ``charge`` says what the request will cost (``admit.lua``, ARGV 20): ``full`` for work for
        the engine; ``twin`` for one parked on an identical request in flight (the tenant's gates
        only); ``hit`` for one answered from the cache (one request of the tenant's rate).

        ``model``, ``deadline_s``, ``max_tokens`` and ``input_tokens`` feed the promise, in engine
        time (its prompt's prefill and its output): refused at once (gate
        global, reason deadline) when its class's queue says it cannot finish in time, on the
        monitor's figures or, while it is away, the live workers' own; ``spent_s``
        of the deadline already went by (the promise judges the rest; Retry-After the whole).
        Raises redis errors (timeouts included) to the caller, which falls back to its floor.
        ``budgets``: the hard budgets it is charged to, each (counter key, limit, reservation) in
        the budget's units, and ``budget_record`` what release.lua gives back from
        (``core/usage/budgets.py``); gate ``budget``, reason ``budget_exhausted`` when one cannot
        hold it, ``budget_unseeded`` when a counter is missing (seed it and ask again).
        ``count``: which refusals the script counts for the usage report ('' none, '*' any, or one
        gate's, for a dry run that stands for that gate's refusal), under ``refusal_field`` + reason
        (``core/usage/refusals.py``).
        ``place``: where its service tier stands in its class (``tier_place``: ``ahead``, ``held`` or
        ''), and ``held_share`` the share of the class's drain held for the tier ahead.
        ``queue`` and ``tier``: the queue it goes to and its service tier, whose fair line
        (``core/broker/fair.py``) the wait is read in: of each other tenant's work in its tier's line,
        only as much as its own tenant has there is ahead of it.
        ``now_ms`` replaces the Redis clock (tests drive time explicitly); leave it None.
        """
        keys = [PLATFORM_BUCKET_KEY, LOAD_LEVEL_KEY, tenant_bucket_key(tenant_id), inflight_key(tenant_id),
                counters_key(priority, model), snapshot_key(priority, model), room_key(priority, model),
                capacity_key(priority, model), BUDGET_CHARGES_KEY, refusals.day_key(time.time()),
                *(counter for counter, _, _ in budgets), RESERVED_KEY, *(seconds_key(q) for q in class_queues(queue))]
        deadline_ms = 2**53 if deadline_s == float("inf") else int(deadline_s * 1000)
        args = [request_id, cost, self.platform_tokens_per_minute, limits.tokens_per_minute,
                limits.requests_per_minute, limits.max_concurrent, priority, int(too_large),
                self.load_level_max_age_ms, self.reject_batch_level, self.shed_level, int(dry_run),
                "" if now_ms is None else now_ms, deadline_ms, max_tokens, self.tight_level, self.tight_factor,
                self.promise_factor, int(spent_s * 1000), charge, self.capacity_max_age_ms,
                class_name(priority, model), class_name("realtime", model), count, refusal_field, input_tokens,
                place, held_share, len(budgets), budget_record]
        for _, limit, amount in budgets:
            args += [limit, amount]
        args += [tier, tenant_id]
        gate, reason, retry, *numbers, basis, budget, budget_spent = self._admit(keys=keys, args=args)
        tl, tr, tz, rl, rr, rz, level, wait, finish = (int(n) for n in numbers)
        return Verdict(_text(gate), _text(reason), int(retry), Quota(tl, tr, tz), Quota(rl, rr, rz), level, wait,
                       finish, _text(basis), int(budget), int(budget_spent))

    def peek(self, tenant_id: str, limits: Limits, *, now_ms: int | None = None) -> Verdict:
        """The tenant's current quotas, charging nothing."""
        return self.admit("", tenant_id, limits, 0, "realtime", dry_run=True, now_ms=now_ms)

    def release(self, request_id: str, tenant_id: str, refund_tokens: int, *, now_ms: int | None = None,
                used_tokens: int = 0, used_micro_usd: int = 0) -> bool:
        """Free the request's concurrency slot and refund its unused tokens, and what its hard
        budgets reserved beyond ``used_tokens`` / ``used_micro_usd``; a no-op the second time."""
        keys = [PLATFORM_BUCKET_KEY, tenant_bucket_key(tenant_id), inflight_key(tenant_id), BUDGET_CHARGES_KEY]
        return bool(self._release(keys=keys, args=[request_id, refund_tokens, "" if now_ms is None else now_ms,
                                                   used_tokens, used_micro_usd]))

    def release_row(self, row) -> bool:
        """Release a finished request from its row (anything with the request row's token columns,
        ``cost`` and ``cache_hit``)."""
        refund = unused_tokens(row.reserved_tokens, row.input_tokens, row.output_tokens, row.started_at is not None)
        return self.release(str(row.id), str(row.tenant_id), refund, used_tokens=used_units("tokens", row),
                            used_micro_usd=used_units("usd", row))

    def in_flight(self, tenant_id: str) -> list[str]:
        return self.redis.zrange(inflight_key(tenant_id), 0, -1)


@functools.lru_cache(maxsize=16)
def limiter_for(client: redis.Redis) -> SharedLimiter:
    """One limiter (registered scripts) per client, for callers outside admission (the sweep)."""
    return SharedLimiter(client)


def reconcile_in_flight(db: Database, limiter: SharedLimiter, grace_s: float = 60.0) -> int:
    """Release in-flight entries whose requests ended without releasing (a crash between the final
    write and the release, a Redis blip) and drop entries whose row was never committed.

    A slot can therefore leak for at most one sweep interval, whoever died. An entry younger than
    ``grace_s`` is left alone when its row is missing: it may be mid-commit.
    """
    seconds, micros = limiter.redis.time()
    cutoff_ms = seconds * 1000 + micros // 1000 - grace_s * 1000
    released = 0
    t = InferenceRequest
    for key in limiter.redis.scan_iter(match=TENANT_LIMIT_PREFIX + "*" + INFLIGHT_SUFFIX, count=500):
        tenant_id = key[len(TENANT_LIMIT_PREFIX):-len(INFLIGHT_SUFFIX)]
        # Bounded by the tenant's concurrency cap: only admitted, unfinished requests are members.
        members = dict(limiter.redis.zrange(key, 0, -1, withscores=True))
        ids = [uuid.UUID(m) for m in members if is_uuid(m)]
        with db.session() as session:
            rows = {str(r.id): r for r in session.execute(
                select(t.id, t.tenant_id, t.status, t.reserved_tokens, t.input_tokens, t.output_tokens,
                       t.started_at, t.cache_hit, t.cost).where(t.id.in_(ids)))}
        for member, admitted_ms in members.items():
            row = rows.get(member)
            if row is not None and row.status.terminal:
                released += limiter.release_row(row)
            elif row is None and admitted_ms < cutoff_ms:
                released += limiter.release(member, tenant_id, 0)
    if released:
        log.warning("reconciled %d in-flight admission slots that were never released", released)
    return released


@functools.cache
def _script(name: str) -> str:
    """A limiter script with the bucket arithmetic it shares (buckets.lua) in front of it."""
    return (_LUA / "buckets.lua").read_text() + (_LUA / name).read_text()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
