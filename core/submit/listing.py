"""Listing what a tenant sent: ``GET /v1/requests`` with filters and a cursor, newest first.

Every query starts from the tenant and walks an index newest first: ``(tenant_id, created_at)``
alone, ``(tenant_id, status, created_at)`` when a status is asked for, and the GIN index on the
metadata for a metadata pair. The cursor is a request id of the page before (``before``): the
next page holds the requests created before it, ``(created_at, id)`` breaking ties, so a page
never repeats or skips a row however many arrive meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Select, or_, select, tuple_

from core.errors import InvalidRequest, NotFound
from core.ids import instant, uuid_or_404
from core.tenants.scopes import Caller
from models import InferenceRequest, Priority, Status
from models.session import Database

_t = InferenceRequest


@dataclass(frozen=True)
class RequestFilter:
    statuses: tuple[Status, ...] = ()
    priority: Priority | None = None
    model: str | None = None  # the model asked for, or the one that ran it
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, args) -> RequestFilter:
        """From a list route's query (a Werkzeug ``MultiDict``): ``status`` (comma-separated),
        ``priority``, ``model``, ``since`` and ``until`` (RFC 3339 or Unix seconds) and
        ``metadata[key]=value`` pairs. Raises InvalidRequest naming each bad one."""
        problems: dict[str, list[str]] = {}
        statuses = []
        for name in filter(None, (args.get("status") or "").split(",")):
            try:
                statuses.append(Status(name))
            except ValueError:
                problems["status"] = [f"One or more of {', '.join(s.value for s in Status)}, comma-separated."]
        priority = None
        if args.get("priority"):
            try:
                priority = Priority(args["priority"])
            except ValueError:
                problems["priority"] = ["realtime or batch."]
        times = {}
        for name in ("since", "until"):
            if args.get(name):
                times[name] = instant(args[name])
                if times[name] is None:
                    problems[name] = ["An RFC 3339 time (2026-12-03T09:00:00Z) or Unix seconds."]
        metadata = {}
        for key, value in args.items(multi=True):
            if key.startswith("metadata[") and key.endswith("]"):
                name = key[len("metadata["):-1]
                if not name or len(name) > 64 or len(value) > 512 or "\x00" in name + value:
                    problems[key[:80]] = ["A metadata key of 1 to 64 characters and a value of at most 512."]
                metadata[name] = value
        if len(metadata) > 4:
            problems["metadata"] = ["At most 4 metadata pairs."]
        model = args.get("model") or None
        if model is not None and (len(model) > 128 or "\x00" in model):
            problems["model"] = ["A model name."]
        if problems:
            raise InvalidRequest("The list's filters are invalid; see details.", details=problems)
        return cls(tuple(statuses), priority, model, times.get("since"), times.get("until"), metadata)


def list_requests(db: Database, caller: Caller, limit: int, before: str | None,
                  where: RequestFilter) -> list[InferenceRequest]:
    """Up to ``limit`` of the requests ``caller`` sees (its tenant's; a key scoped ``own``: those
    it made) matching ``where``, newest first, created before the request ``before``."""
    query = listing_query(caller, limit, where)
    with db.session() as session:
        if before:  # a cursor is a row the caller sees; anything else is a 404, as GET of it would be
            rid = uuid_or_404(before, "request", hint="before is the id of a request on the page before")
            anchor = session.execute(select(_t.created_at, _t.id).where(
                _t.id == rid, caller.sees(_t.tenant_id, _t.api_key_id, "requests"))).first()
            if anchor is None:
                raise NotFound("before names no request of this API key.")
            query = query.where(tuple_(_t.created_at, _t.id) < tuple_(anchor.created_at, anchor.id))
        return list(session.scalars(query).all())


def listing_query(caller: Caller, limit: int, where: RequestFilter) -> Select:
    """The list's query, before its cursor is applied: the rows ``caller``'s key sees (an ``own``
    key's also by ``api_key_id``, filtered while the tenant's index is walked)."""
    visible = caller.sees(_t.tenant_id, _t.api_key_id, "requests")
    query = select(_t).where(visible).order_by(_t.created_at.desc(), _t.id.desc()).limit(limit)
    if where.statuses:
        query = query.where(_t.status.in_(where.statuses))
    if where.priority is not None:
        query = query.where(_t.priority == where.priority)
    if where.model is not None:
        query = query.where(or_(_t.model_requested == where.model, _t.model_used == where.model))
    if where.since is not None:
        query = query.where(_t.created_at >= where.since)
    if where.until is not None:
        query = query.where(_t.created_at < where.until)
    if where.metadata:
        query = query.where(_t.meta.contains(where.metadata))
    return query
