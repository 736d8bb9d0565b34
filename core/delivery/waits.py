"""Holding a client's connection until its request ends (``Prefer: wait``), and noticing that
a client has left: its connection closed while it waited or streamed, or, for a polling client
that declared ``abandon_after_s``, no poll for that long.

A client that left is not coming back for the answer, so its request is cancelled (a queued one
never runs, a running one is aborted in the engine and its KV freed) unless it said
``"detach": true``. Waking is by notification (``core/delivery/notify.py``), not by reading the row in
a loop; the row is read when a move is announced, or when announcements may have been missed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from core.errors import ApiError
from core.observe.submit_metrics import ABANDONED
from core.rediskeys import ABANDON_KEY
from core.services import Services
from core.tenants.scopes import Caller
from models import InferenceRequest

log = logging.getLogger(__name__)
GONE_CHECK_S = 1.0  # how often a waiting connection is checked for a client that closed it
# Take the overdue members out in one step, so a poll landing meanwhile is either before
# (the member is no longer due) or after (the member is gone; the request is being cancelled).
_TAKE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return due
"""


def until_ended(svc: Services, tenant_id: uuid.UUID, row: InferenceRequest, wait_s: float,
                gone: Callable[[], bool]) -> InferenceRequest:
    """The request's row once it has ended, or as it is after ``wait_s`` seconds.

    A client that closes the connection meanwhile (``gone()``, the web tier's check, says so) has
    left: its request is cancelled unless it detached, and the row is returned at once (nobody
    reads the answer)."""
    if row.status.terminal or wait_s <= 0:
        return row
    rid = str(row.id)
    until = time.monotonic() + wait_s
    polled(svc, row, present_for_s=wait_s)  # a waiting client is here: no abandonment while it waits
    with svc.waiters.watch(rid) as watch:
        row = svc.requests.get(Caller(tenant_id), rid)  # read after the watch began: no move slips between
        while not row.status.terminal:
            left = until - time.monotonic()
            if left <= 0:
                break
            moved = svc.waiters.wait(watch, min(left, GONE_CHECK_S))
            if gone():
                abandon(svc, row, "wait")
                break
            if moved:
                row = svc.requests.get(Caller(tenant_id), rid)
    polled(svc, row)
    return row


def abandon(svc: Services, row: InferenceRequest, how: str) -> None:
    """The client of ``row`` left (``how``: wait, stream, poll): cancel it unless it detached."""
    if row.params.get("detach"):
        return
    try:
        svc.requests.cancel(Caller(row.tenant_id), str(row.id))
    except ApiError:  # it ended meanwhile (or is gone): nothing left to stop
        return
    ABANDONED.labels(how).inc()
    log.info("client left (%s): request cancelled", how)


def remember_poller(svc: Services, row: InferenceRequest) -> None:
    """A request whose client polls with ``abandon_after_s``: due for abandonment unless the
    next poll comes before then (each poll pushes the date back, :func:`polled`)."""
    after = row.params.get("abandon_after_s")
    if after and not row.status.terminal:
        _schedule(svc, row, after, only_existing=False)


def polled(svc: Services, row: InferenceRequest, present_for_s: float = 0) -> None:
    """The client of ``row`` asked about it now (and stays ``present_for_s`` more: a wait)."""
    after = row.params.get("abandon_after_s")
    if after and not row.status.terminal:
        _schedule(svc, row, present_for_s + after, only_existing=True)


def _schedule(svc: Services, row: InferenceRequest, after: float, only_existing: bool) -> None:
    try:
        svc.admission.redis.zadd(ABANDON_KEY, {f"{row.id} {row.tenant_id}": time.time() + after},
                                 xx=only_existing)
    except Exception:  # abandonment is a saving, not a promise: Redis away, the request just runs
        log.warning("could not record the poll deadline of a request", exc_info=True)


def abandon_idle_pollers(svc: Services, limit: int = 1000) -> int:
    """Cancel requests whose polling client is overdue (the sweep calls this); returns how many."""
    due = svc.redis.eval(_TAKE_DUE, 1, ABANDON_KEY, time.time(), limit)
    count = 0
    for member in due:
        rid, tenant_id = member.split(" ", 1)
        try:
            row = svc.requests.get(Caller(uuid.UUID(tenant_id)), rid)
        except ApiError:
            continue
        if not row.status.terminal:
            abandon(svc, row, "poll")
            count += 1
    return count
