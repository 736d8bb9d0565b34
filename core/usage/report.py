"""The usage report: ``GET /v1/usage`` (a tenant), ``GET /v1/admin/usage`` (every tenant), CSV,
``sluice usage``, the dashboard's panel.

Read from the rollups only (``models/usage.py``: hourly, and daily for error codes and refusals),
never from the request table, so a month costs the same however many requests it held. An hourly
report gives error codes and refusals in its totals only, for the whole days it touches. The
answer is shaped like OpenAI's usage API: a page of time buckets (``start_time``/``end_time`` in
Unix seconds), each with one result per group (``group_by``: model, priority, service_tier, key,
source; and tenant for the operator).
"""

from __future__ import annotations

import csv
import io
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Select, func, literal, select

from core.errors import InvalidRequest
from core.ids import instant
from models import ApiKey, Tenant, UsageHourly, UsageOutcome
from models.session import Database
from models.usage import NO_KEY

BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
# Bucket counts a report may span: a month of hours, a year of days.
MAX_BUCKETS = {"hour": 24 * 31, "day": 366}
GROUPS = ("model", "priority", "service_tier", "key", "source")
ADMIN_GROUPS = ("tenant", *GROUPS)
_COLUMN = {"model": "model", "priority": "priority", "service_tier": "service_tier", "key": "api_key_id",
           "source": "source", "tenant": "tenant_id"}
SUMS = ("requests", "cache_hits", "input_tokens", "cached_tokens", "output_tokens", "billed_tokens")
STATUSES = ("succeeded", "failed", "timed_out", "cancelled", "expired")


@dataclass(frozen=True)
class UsageQuery:
    start: datetime
    end: datetime
    bucket: str  # hour | day
    group_by: tuple[str, ...]
    tenant_id: uuid.UUID | None  # None: every tenant (the operator's report)
    api_key_id: uuid.UUID | None = None  # set: that key's usage only (a key scoped own asking)

    @classmethod
    def parse(cls, args, tenant_id: uuid.UUID | None, now: datetime | None = None) -> UsageQuery:
        """From a route's query: ``start`` (default: the start of this month, UTC) and ``end``
        (default: now), RFC 3339 or Unix seconds; ``bucket`` hour or day (default day);
        ``group_by`` comma-separated; ``tenant`` (the operator's report only, an id)."""
        now = now or datetime.now(UTC)
        problems: dict[str, list[str]] = {}
        bounds = {}
        for name, default in (("start", now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)),
                              ("end", now)):
            raw = args.get(name) or args.get(f"{name}_time")
            bounds[name] = default if not raw else instant(raw)
            if bounds[name] is None:
                problems[name] = ["An RFC 3339 time (2026-12-01T00:00:00Z) or Unix seconds."]
        bucket = args.get("bucket") or args.get("bucket_width") or "day"
        bucket = {"1h": "hour", "1d": "day"}.get(bucket, bucket)
        if bucket not in BUCKETS:
            problems["bucket"] = ["hour or day."]
        allowed = ADMIN_GROUPS if tenant_id is None else GROUPS
        group_by = tuple(dict.fromkeys(g.strip() for g in (args.get("group_by") or "").split(",") if g.strip()))
        if set(group_by) - set(allowed):
            problems["group_by"] = [f"Comma-separated, from {', '.join(allowed)}."]
        if tenant_id is None and args.get("tenant"):
            try:
                tenant_id = uuid.UUID(args["tenant"])
            except ValueError:
                problems["tenant"] = ["A tenant id."]
        if not problems and bounds["start"] >= bounds["end"]:
            problems["end"] = ["After start."]
        if problems:
            raise InvalidRequest("The usage query is invalid; see details.", details=problems)
        start = floor(bounds["start"], bucket)
        if (bounds["end"] - start) / BUCKETS[bucket] > MAX_BUCKETS[bucket]:
            raise InvalidRequest(f"At most {MAX_BUCKETS[bucket]} {bucket} buckets per report; narrow start and end "
                                 "or use a wider bucket.", details={"end": ["Too far from start."]})
        return cls(start, bounds["end"], bucket, group_by, tenant_id)


def floor(moment: datetime, bucket: str) -> datetime:
    moment = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if bucket == "day" else moment


def _grouped(table, query: UsageQuery, *extra) -> Select:
    """The hourly rollups of the query's range, summed per bucket and group."""
    width = "day" if query.bucket == "day" else "hour"
    bucket = (func.date_trunc(width, table.hour.op("AT TIME ZONE")(literal("UTC")))
              .op("AT TIME ZONE")(literal("UTC")))
    groups = [getattr(table, _COLUMN[g]) for g in query.group_by]
    statement = select(bucket, *groups, *extra).where(table.hour >= query.start, table.hour < query.end)
    if query.tenant_id is not None:
        statement = statement.where(table.tenant_id == query.tenant_id)
    if query.api_key_id is not None:
        statement = statement.where(table.api_key_id == query.api_key_id)
    return statement.group_by(bucket, *groups).order_by(bucket, *groups)


def _outcomes(query: UsageQuery) -> Select:
    """Error codes and refusals of the days the range touches: per day and group for a daily
    report; for an hourly one, per code only (they go to its totals: they are kept per day)."""
    o = UsageOutcome
    daily = query.bucket == "day"
    keys = [o.day, *(getattr(o, _COLUMN[g]) for g in query.group_by)] if daily else []
    statement = select(*keys, o.kind, o.code, func.sum(o.count)).where(
        o.day >= floor(query.start, "day"), o.day < query.end)
    if query.tenant_id is not None:
        statement = statement.where(o.tenant_id == query.tenant_id)
    if query.api_key_id is not None:
        statement = statement.where(o.api_key_id == query.api_key_id)
    return statement.group_by(*keys, o.kind, o.code)


def usage(db: Database, query: UsageQuery) -> dict[str, Any]:
    """The report: ``{object: page, data: [buckets], totals, has_more: false, next_page: null}``;
    every bucket of the range is present, an empty one with no results."""
    u = UsageHourly
    sums = [func.sum(getattr(u, c)) for c in (*SUMS, *STATUSES)] + [func.sum(u.cost)]
    width = len(query.group_by) + 1  # the bucket and the groups: a result's identity
    with db.session() as session:
        connection = session.connection()  # plain rows: a month of groups is many thousands
        rows = connection.execute(_grouped(u, query, *sums)).all()
        outcomes = connection.execute(_outcomes(query)).all()
        names = _key_names(session, rows, query) if "key" in query.group_by else {}
        tenants = _tenant_names(session, rows, query) if "tenant" in query.group_by else {}
    results: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        ident = row[:width]
        result = results.get(ident)
        if result is None:
            result = results[ident] = _empty(ident, query, names, tenants)
        for i, name in enumerate(SUMS, start=width):
            result[name] += int(row[i])
        for i, status in enumerate(STATUSES, start=width + len(SUMS)):
            if row[i]:
                result["statuses"][status] = result["statuses"].get(status, 0) + int(row[i])
        result["_cost"] += row[-1]
    ordered = True  # as the rollups' query sorted them, unless a group has only refusals
    totals = _zero()
    for row in outcomes:
        if query.bucket == "day":
            ident = row[:width]
            result = results.get(ident)
            if result is None:
                result = results[ident] = _empty(ident, query, names, tenants)
                ordered = False
        else:  # an hourly report: the totals only, added there straight
            result = totals
        kind, code, n = row[-3:]
        field = "errors" if kind == "error" else "refusals"
        result[field][code] = result[field].get(code, 0) + int(n)
    by_bucket: dict[datetime, list[dict[str, Any]]] = defaultdict(list)
    idents = results if ordered else sorted(results, key=lambda k: tuple("" if v is None else str(v) for v in k))
    for ident in idents:
        result = results[ident]
        _add(totals, result)
        by_bucket[ident[0].astimezone(UTC)].append(_finish(result))
    step = BUCKETS[query.bucket]
    data, at = [], query.start
    while at < query.end:
        data.append({"object": "bucket", "start_time": int(at.timestamp()), "end_time": int((at + step).timestamp()),
                     "results": by_bucket.get(at, [])})
        at += step
    return {"object": "page", "data": data, "totals": _finish(totals), "has_more": False, "next_page": None}


def _zero() -> dict[str, Any]:
    return {**dict.fromkeys(SUMS, 0), "_cost": Decimal(0), "statuses": {}, "errors": {}, "refusals": {}}


def _empty(ident: tuple, query: UsageQuery, names: dict, tenants: dict) -> dict[str, Any]:
    result: dict[str, Any] = {"object": "sluice.usage.result"}
    for group in ADMIN_GROUPS if query.tenant_id is None else GROUPS:
        result[_field(group)] = None
    for group, value in zip(query.group_by, ident[1:], strict=True):
        if group == "key":
            result["api_key_id"] = None if value == NO_KEY else str(value)
            result["api_key_name"] = names.get(value)
        elif group == "tenant":
            result["tenant_id"], result["tenant_name"] = str(value), tenants.get(value)
        else:
            result[group] = value
    return {**result, **_zero()}


def _field(group: str) -> str:
    return {"key": "api_key_id", "tenant": "tenant_id"}.get(group, group)


def _add(totals: dict[str, Any], result: dict[str, Any]) -> None:
    for name in SUMS:
        totals[name] += result[name]
    totals["_cost"] += result["_cost"]
    for field in ("statuses", "errors", "refusals"):
        for code, n in result[field].items():
            totals[field][code] = totals[field].get(code, 0) + n


def _finish(result: dict[str, Any]) -> dict[str, Any]:
    """``cost`` as OpenAI's costs API writes an amount; ``cost_usd`` the exact decimal, as a string;
    ``num_model_requests`` and ``input_cached_tokens`` under OpenAI's names too."""
    cost = result.pop("_cost")
    result["num_model_requests"] = result["requests"]
    result["input_cached_tokens"] = result["cached_tokens"]
    result["cost"] = {"value": float(cost), "currency": "usd"}
    result["cost_usd"] = str(cost.quantize(Decimal("1e-10")))
    return result


def _key_names(session, rows, query: UsageQuery) -> dict[uuid.UUID, str | None]:
    ids = {r[1 + query.group_by.index("key")] for r in rows} - {NO_KEY}
    return dict(session.execute(select(ApiKey.id, ApiKey.name).where(ApiKey.id.in_(ids))).all()) if ids else {}


def _tenant_names(session, rows, query: UsageQuery) -> dict[uuid.UUID, str]:
    ids = {r[1 + query.group_by.index("tenant")] for r in rows}
    return dict(session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).all()) if ids else {}


CSV_COLUMNS = ("start_time", "end_time", "tenant_id", "tenant_name", "model", "priority", "service_tier",
               "api_key_id", "api_key_name", "source", *SUMS, "cost_usd", "errors", "refusals")


def as_csv(report: dict[str, Any]) -> str:
    """One line per result of each bucket (empty buckets left out); times in RFC 3339, UTC;
    errors and refusals as ``code=n;code=n``."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for bucket in report["data"]:
        for result in bucket["results"]:
            line = {**result, "start_time": _rfc3339(bucket["start_time"]), "end_time": _rfc3339(bucket["end_time"]),
                    "errors": _pairs(result["errors"]), "refusals": _pairs(result["refusals"])}
            writer.writerow(["" if line.get(c) is None else line[c] for c in CSV_COLUMNS])
    return out.getvalue()


def _rfc3339(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _pairs(counts: dict[str, int]) -> str:
    return ";".join(f"{code}={n}" for code, n in sorted(counts.items()))
