"""Budgets: a tenant's, or one of its keys', tokens or USD over a day, a week, a month (UTC
calendar windows) or a fixed window.

A **hard** budget is charged at admission, inside the one Lua call that charges every other
limit (``core/admission/lua/admit.lua``): a counter in Redis per budget and window holds what
the window's requests used (once ended) or may still use (their reservation: input + n ×
max_tokens, or that at the model's prices). A request whose reservation does not fit what is
left is refused (429 ``budget_exhausted``) and charged nothing; one that fits is charged before
any engine runs. When it ends, ``release.lua`` gives back what it reserved and did not use
(exactly once, with its concurrency slot). Concurrent submits therefore never take the counter
past the budget; only a request that used more input tokens than admission estimated can, by
that difference.

A counter that is missing (a new window, Redis restarted) is seeded from Postgres before any
request is charged to it: the window's ended usage from the rollups plus the reservations of its
requests still in flight. Those requests' reservations are then never given back (their charge
records went with Redis): the counter over-counts, it never under-counts.

A **soft** budget only warns: the sweep sends ``budget.threshold`` to the budget's webhook when
the window's ended usage crosses 50, 80 and 100 % (once each per window). Hard budgets with a
webhook warn the same way.

Budgets are read from Postgres at most every ``CACHE_S`` seconds per process: a new or removed
budget takes effect within that time.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import redis
from sqlalchemy import delete, func, or_, select, update

from core.errors import BudgetExhausted, InvalidRequest, NotFound
from core.hooks import check_url, require_secret
from core.ssrf import AllowList
from models import ApiKey, Budget, InferenceRequest, Status, Tenant, UsageHourly
from models.session import Database

if TYPE_CHECKING:
    from core.submit.plan import Plan

UNITS = ("tokens", "usd")
PERIODS = ("day", "week", "month", "fixed")
THRESHOLDS = (50, 80, 100)
CACHE_S = 5.0
MICRO = 1_000_000  # a USD counter counts micro-dollars, so Lua's doubles stay exact integers
CHARGES_KEY = "sluice:budget:charges"  # hash: request id → "unit amount counter;…", until released
_COUNTER = "sluice:budget:{id}:{start}"


@dataclass(frozen=True)
class Rule:
    """A budget as admission and the sweep use it (a row's values, detached from its session)."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    api_key_id: uuid.UUID | None
    unit: str
    amount: Decimal
    period: str
    starts_at: datetime | None
    ends_at: datetime | None
    hard: bool
    webhook_url: str | None

    @classmethod
    def of(cls, row: Budget) -> Rule:
        return cls(row.id, row.tenant_id, row.api_key_id, row.unit, row.amount, row.period, row.starts_at,
                   row.ends_at, row.hard, row.webhook_url)

    def window(self, now: datetime) -> tuple[datetime, datetime] | None:
        """The window in force at ``now`` (UTC), or None (a fixed window not begun or over)."""
        if self.period == "fixed":
            return (self.starts_at, self.ends_at) if self.starts_at <= now < self.ends_at else None
        day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        if self.period == "day":
            return day, day + timedelta(days=1)
        if self.period == "week":
            start = day - timedelta(days=day.weekday())
            return start, start + timedelta(days=7)
        start = day.replace(day=1)
        return start, (start + timedelta(days=32)).replace(day=1)

    @property
    def limit(self) -> int:
        """The budget in counter units: tokens, or micro-dollars."""
        return int(self.amount) if self.unit == "tokens" else int(self.amount * MICRO)

    def counter(self, start: datetime) -> str:
        return _COUNTER.format(id=self.id, start=int(start.timestamp()))

    def show(self, units: int) -> str:
        """An amount in counter units as a person reads it."""
        return f"{units:,} tokens" if self.unit == "tokens" else f"${Decimal(units) / MICRO:,.2f}"

    @property
    def scope(self) -> str:
        return "This API key's" if self.api_key_id else "Your"


@dataclass(frozen=True)
class Charge:
    """What one hard budget is charged for one request at admission."""

    rule: Rule
    counter: str
    amount: int  # counter units
    resets_at: datetime


def reservation_units(unit: str, plan: Plan) -> int:
    """A plan's reservation in a budget's unit: its reserved tokens, or what they would cost
    (every input token uncached, every output token of ``n × max_tokens``), rounded up."""
    if unit == "tokens":
        return plan.reserved_tokens
    return micro(plan.price.cost(plan.input_tokens, 0, plan.reserved_tokens - plan.input_tokens))


def micro(cost: Decimal) -> int:
    return math.ceil(cost * MICRO)


def used_units(unit: str, row: Any) -> int:
    """What an ended request used, in a budget's unit (``release.lua`` gives back the rest): the
    tokens an engine computed for it, or its cost; nothing for an answer no engine computed."""
    if getattr(row, "cache_hit", False) or row.output_tokens is None:
        return 0
    if unit == "tokens":
        return row.input_tokens + row.output_tokens
    return micro(row.cost)


class Budgets:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._cache: dict[uuid.UUID, tuple[float, list[Rule]]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ admission

    def rules(self, tenant_id: uuid.UUID) -> list[Rule]:
        """The tenant's budgets and its keys' (read at most every CACHE_S seconds)."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(tenant_id)
        if cached is not None and now - cached[0] < CACHE_S:
            return cached[1]
        with self.db.session() as session:
            rules = [Rule.of(b) for b in session.scalars(select(Budget).where(Budget.tenant_id == tenant_id))]
        with self._lock:
            self._cache[tenant_id] = (now, rules)
        return rules

    def forget(self, tenant_id: uuid.UUID) -> None:
        with self._lock:
            self._cache.pop(tenant_id, None)

    def in_force(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None, now: datetime
                 ) -> Iterator[tuple[Rule, tuple[datetime, datetime]]]:
        """The hard budgets a request of ``key_id`` is charged to (its tenant's, and its key's own),
        each with its window now; budgets of other keys and fixed windows not in force left out."""
        for rule in self.rules(tenant_id):
            if rule.hard and rule.api_key_id in (None, key_id):
                window = rule.window(now)
                if window is not None:
                    yield rule, window

    def charges(self, plan: Plan, now: datetime | None = None) -> list[Charge]:
        """The hard budgets ``plan`` is charged to, with the amounts."""
        return [Charge(rule, rule.counter(start), reservation_units(rule.unit, plan), end)
                for rule, (start, end) in self.in_force(plan.tenant_id, plan.api_key_id, now or datetime.now(UTC))]

    def seed(self, client: redis.Redis, charge: Charge, now: datetime | None = None) -> None:
        """Create a missing counter from Postgres: the window's ended usage and its in-flight
        reservations. SET NX: of several processes seeding at once, the first one's value stands."""
        now = now or datetime.now(UTC)
        rule = charge.rule
        start, end = rule.window(now) or (now, charge.resets_at)
        with self.db.session() as session:
            ended, in_flight = self._spent(session, rule, start, end, in_flight=True)
        client.set(charge.counter, ended + in_flight, nx=True,
                   exat=int((end + timedelta(days=2)).timestamp()))

    def refusal(self, charge: Charge, spent: int) -> BudgetExhausted:
        rule = charge.rule
        left = max(rule.limit - spent, 0)
        retry_s = max(1, math.ceil((charge.resets_at - datetime.now(UTC)).total_seconds()))
        period = "fixed-window" if rule.period == "fixed" else {"day": "daily", "week": "weekly",
                                                                 "month": "monthly"}[rule.period]
        return BudgetExhausted(
            f"{rule.scope} {period} budget of {rule.show(rule.limit)} is used up: {rule.show(spent)} used or "
            f"reserved, {rule.show(left)} left, and this request may need up to {rule.show(charge.amount)}. "
            f"It resets at {charge.resets_at.isoformat().replace('+00:00', 'Z')}; lower max_tokens, or ask the "
            "platform's operator for more.",
            headers={"Retry-After": str(retry_s), "retry-after-ms": str(retry_s * 1000)},
            details={"budget_id": str(rule.id), "unit": rule.unit, "period": rule.period,
                     "limit": _amount(rule, rule.limit), "used": _amount(rule, spent),
                     "remaining": _amount(rule, left), "requested": _amount(rule, charge.amount),
                     "resets_at": charge.resets_at.isoformat(), "scope": "key" if rule.api_key_id else "tenant"})

    def covers(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None, tokens: int, cost: Decimal,
               queued: Sequence[tuple[uuid.UUID | None, int, Decimal]] = ()) -> None:
        """Raise ``budget_exhausted`` when a hard budget in force cannot hold ``tokens`` (or
        ``cost``) on top of what its window already used and holds in flight (Postgres's figures)
        and what the tenant's other unfinished jobs have queued (``queued``: (their key, tokens,
        cost) of items not started yet; a key's budget counts its own key's): a bulk job refused at
        submit."""
        in_force = list(self.in_force(tenant_id, key_id, datetime.now(UTC)))  # read before: its own session
        if not in_force:
            return
        with self.db.session() as session:  # one for every budget's figures
            for rule, (start, end) in in_force:
                needed = tokens if rule.unit == "tokens" else micro(cost)
                spent = sum(self._spent(session, rule, start, end, in_flight=True)) + sum(
                    (queued_tokens if rule.unit == "tokens" else micro(queued_cost))
                    for queued_key, queued_tokens, queued_cost in queued
                    if rule.api_key_id is None or queued_key == rule.api_key_id)
                if spent + needed > rule.limit:
                    raise self.refusal(Charge(rule, rule.counter(start), needed, end), spent)

    # ------------------------------------------------------------------ reading

    def _spent(self, session, rule: Rule, start: datetime, end: datetime, *, in_flight: bool) -> tuple[int, int]:
        """A window's ended usage (from the rollups) and, when asked, its in-flight reservations,
        in the rule's counter units."""
        u, t = UsageHourly, InferenceRequest
        used = u.billed_tokens if rule.unit == "tokens" else u.cost
        query = select(func.coalesce(func.sum(used), 0)).where(u.tenant_id == rule.tenant_id, u.hour >= start,
                                                                u.hour < end)
        if rule.api_key_id is not None:
            query = query.where(u.api_key_id == rule.api_key_id)
        ended = session.scalar(query)
        ended = int(ended) if rule.unit == "tokens" else micro(ended)
        if not in_flight:
            return ended, 0
        reserved = (t.reserved_tokens if rule.unit == "tokens" else
                    (t.input_tokens * t.price_input + (t.reserved_tokens - t.input_tokens) * t.price_output) / MICRO)
        query = select(func.coalesce(func.sum(reserved), 0)).where(
            t.tenant_id == rule.tenant_id, t.status.in_((Status.QUEUED, Status.RUNNING)), t.created_at >= start,
            t.created_at < end)
        if rule.api_key_id is not None:
            query = query.where(t.api_key_id == rule.api_key_id)
        flying = session.scalar(query)
        return ended, int(flying) if rule.unit == "tokens" else micro(flying)

    def views(self, tenant_id: uuid.UUID, client: redis.Redis | None = None,
              key_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
        """The tenant's budgets as the API shows them (``key_id``: only that key's own, what a key
        scoped ``own`` sees), each with its window's ``used`` (ended requests, from the rollups),
        ``reserved`` (a hard budget's live counter beyond that) and ``remaining``."""
        now = datetime.now(UTC)
        query = select(Budget).where(Budget.tenant_id == tenant_id)
        if key_id is not None:
            query = query.where(Budget.api_key_id == key_id)
        with self.db.session() as session:
            rows = list(session.scalars(query.order_by(Budget.created_at)))
            views = []
            for row in rows:
                rule = Rule.of(row)
                window = rule.window(now)
                used = self._spent(session, rule, *window, in_flight=False)[0] if window else 0
                live = _counter(client, rule.counter(window[0])) if window and rule.hard else None
                held = max(live - used, 0) if live is not None else 0
                views.append(view(row, window, used, held))
        return views

    # ------------------------------------------------------------------ managing

    def create(self, tenant: Tenant, values: dict[str, Any], allow: AllowList) -> dict[str, Any]:
        """Add a budget to ``tenant`` (``values``: the columns), checked as the admin API and the CLI
        both need: a fixed window on whole hours and only for ``fixed``, a whole number of tokens,
        a key of this tenant, a webhook URL the SSRF guard (``allow``) lets through and a tenant
        that can sign it. Raises InvalidRequest naming the field; returns the budget's view."""
        # Here, not at the top: core/delivery/webhooks.py imports admission, which imports this module.

        window = [values.get("starts_at"), values.get("ends_at")]
        fixed = values["period"] == "fixed"
        if fixed != all(window) or (fixed and (window[0] >= window[1] or any(
                t.minute or t.second or t.microsecond for t in window))):
            raise InvalidRequest("A fixed budget needs starts_at before ends_at, both on whole hours; the other "
                                 "periods take neither.",
                                 details={"starts_at": ["Whole hours, only with period fixed."]})
        if values["unit"] == "tokens" and values["amount"] != values["amount"].to_integral_value():
            raise InvalidRequest("A token budget is a whole number of tokens.",
                                 details={"amount": ["A whole number of tokens."]})
        with self.db.session() as session:
            if values.get("api_key_id") and session.scalar(select(ApiKey.tenant_id).where(
                    ApiKey.id == values["api_key_id"])) != tenant.id:
                raise InvalidRequest(f"api_key_id names no key of tenant {tenant.name}.",
                                     details={"api_key_id": ["One of the tenant's key ids."]})
            if values.get("webhook_url"):
                check_url(values["webhook_url"], allow)
                require_secret(tenant)
            row = Budget(id=uuid.uuid4(), tenant_id=tenant.id, **values)
            session.add(row)
            session.flush()
            session.refresh(row)
            rule = Rule.of(row)
            window = rule.window(datetime.now(UTC))
            shown = view(row, window, self._spent(session, rule, *window, in_flight=False)[0] if window else 0, 0)
        self.forget(tenant.id)
        return shown

    def delete(self, budget_id: uuid.UUID) -> None:
        with self.db.session() as session:
            tenant_id = session.scalar(delete(Budget).where(Budget.id == budget_id).returning(Budget.tenant_id))
        if tenant_id is None:
            raise NotFound(f"No budget {budget_id}.")
        self.forget(tenant_id)

    # ------------------------------------------------------------------ the sweep's

    def thresholds(self, record) -> list[uuid.UUID]:
        """Announce every threshold a budget with a webhook crossed in its window since the last
        announcement: ``record(session, budget, data)`` inserts the delivery (returns its
        id, or None), in the transaction that notes the threshold, so each is sent once. Returns
        the deliveries to publish once committed."""
        now = datetime.now(UTC)
        published = []
        with self.db.session() as session:
            rows = list(session.scalars(select(Budget).where(Budget.webhook_url.is_not(None))))
            for row in rows:
                rule = Rule.of(row)
                window = rule.window(now)
                if window is None:
                    continue
                used = self._spent(session, rule, *window, in_flight=False)[0]
                percent = 100 * used / max(rule.limit, 1)
                crossed = max((t for t in THRESHOLDS if percent >= t), default=0)
                before = row.notified_percent if row.notified_window == window[0] else 0
                if crossed <= before:
                    continue
                noted = session.execute(update(Budget).where(
                    Budget.id == row.id, or_(Budget.notified_window.is_distinct_from(window[0]),
                                             Budget.notified_percent < crossed))
                    .values(notified_window=window[0], notified_percent=crossed)).rowcount
                if noted:
                    delivery = record(session, row, {**view(row, window, used, 0), "threshold_percent": crossed})
                    if delivery is not None:
                        published.append(delivery)
        return published


def view(row: Budget, window: tuple[datetime, datetime] | None, used: int, held: int) -> dict[str, Any]:
    rule = Rule.of(row)
    return {
        "object": "budget", "id": str(row.id), "api_key_id": str(row.api_key_id) if row.api_key_id else None,
        "unit": row.unit, "amount": float(row.amount), "period": row.period, "hard": row.hard,
        "starts_at": row.starts_at.isoformat() if row.starts_at else None,
        "ends_at": row.ends_at.isoformat() if row.ends_at else None, "webhook_url": row.webhook_url,
        "window_start": window[0].isoformat() if window else None,
        "resets_at": window[1].isoformat() if window else None,
        "used": _amount(rule, used), "reserved": _amount(rule, held),
        "remaining": _amount(rule, max(rule.limit - used - held, 0)),
        "used_percent": round(100 * used / max(rule.limit, 1), 2),
    }


def _amount(rule: Rule, units: int) -> float | int:
    return units if rule.unit == "tokens" else units / MICRO


def _counter(client: redis.Redis | None, key: str) -> int | None:
    if client is None:
        return None
    try:
        value = client.get(key)
    except redis.RedisError:
        return None
    return None if value is None else int(value)
