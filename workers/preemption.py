"""Preemption across the fleet: one queued realtime request makes one worker yield a batch slot,
and one queued request of the priority tier makes one worker yield a default request's slot.

Every worker that reads a shared realtime queue sees the same queued messages (LLEN). Left to
itself each would take batch work out of its engine for each of them: with four workers, one
question waiting would preempt four batch requests, three of them for nothing. So a worker asks
first, in one Redis script (:class:`Claims`): of the realtime requests queued on its model's
queues, how many has no other worker claimed to make room for? It preempts for those only, and
its claim stands until it sees the realtime queues empty (or ``CLAIM_TTL_S`` at most).

A batch request is preempted at most ``MAX_PREEMPTIONS`` times (counted in Redis per request, for
as long as a batch request can wait): after that it runs to its end where it is, so bulk work
that realtime keeps interrupting still finishes. A default request is taken out for the priority
tier ``MAX_TIER_PREEMPTIONS`` times at most.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

CLAIMS_PREFIX = "sluice:preempt:claims:"  # hash worker → "<slots> <until ms>", per model
COUNT_PREFIX = "sluice:preempt:count:"  # string per request: times it was preempted
# How long a claim stands at most: the room it made takes the realtime message in within a fetch
# or two, and the worker drops its claim as soon as it sees no realtime queued.
CLAIM_TTL_S = 10.0
MAX_PREEMPTIONS = 3
# A default request is taken out for the priority tier once at most: it is realtime work with a
# deadline of its own, and each time it starts over it loses what it had decoded.
MAX_TIER_PREEMPTIONS = 1
COUNT_TTL_S = 86400

_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local others = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local n, untl = string.match(all[i + 1], '^(%S+) (%S+)$')
  if not untl or tonumber(untl) < now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] then
    others = others + tonumber(n)
  end
end
-- Queued as the lists hold it now (KEYS 2..), not as the caller read it a moment ago: a reading
-- taken before another worker consumed the message and released its claim would grant again.
local queued = tonumber(ARGV[3])
if #KEYS > 1 then
  local now_queued = 0
  for k = 2, #KEYS do now_queued = now_queued + redis.call('LLEN', KEYS[k]) end
  queued = math.min(queued, now_queued)
end
local grant = math.max(0, math.min(tonumber(ARGV[2]), queued - others))
if grant > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], grant .. ' ' .. (now + tonumber(ARGV[4])))
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return grant
"""


class Claims:
    """The preemptions one worker may make for realtime requests queued on its model's queues."""

    def __init__(self, client: redis.Redis, worker_id: str, model: str, tier: str | None = None,
                 lists: list[str] = ()) -> None:
        self.redis = client
        self.worker_id = worker_id
        # The broker's lists the queued requests wait in, read again inside each grant.
        self.lists = list(lists)
        # Claims for one tier's queued requests (the priority tier's, taking default work out) are
        # counted apart from those for every realtime request (taking batch work out).
        self.key = CLAIMS_PREFIX + model + (f":{tier}" if tier else "")
        self.cap = MAX_PREEMPTIONS if tier is None else MAX_TIER_PREEMPTIONS
        self._claim = client.register_script(_CLAIM)
        self._claimed = False

    def grant(self, want: int, queued: int) -> int:
        """Of ``want`` slots this worker would free for ``queued`` realtime requests, how many it
        may: those no other worker claimed. With Redis away, none (the level and the promise
        still protect realtime; batch keeps its place)."""
        if want <= 0 or queued <= 0:
            return 0
        try:
            granted = int(self._claim(keys=[self.key, *self.lists],
                                      args=[self.worker_id, want, queued, int(CLAIM_TTL_S * 1000)]))
            self._claimed = self._claimed or granted > 0
            return granted
        except redis.RedisError as exc:
            log.warning("preemption claim not made (%s)", type(exc).__name__)
            return 0

    def release(self) -> None:
        """No realtime is queued any more: this worker's claim, if it made one, is spent."""
        if not self._claimed:
            return
        try:
            self.redis.hdel(self.key, self.worker_id)
            self._claimed = False
        except redis.RedisError as exc:
            log.warning("preemption claim not released (%s); it lapses by itself", type(exc).__name__)

    def exhausted(self, request_ids: list[str]) -> set[str]:
        """Those of ``request_ids`` already preempted as often as this tier's cap allows."""
        if not request_ids:
            return set()
        try:
            counts = self.redis.mget([COUNT_PREFIX + rid for rid in request_ids])
        except redis.RedisError:
            return set()
        return {rid for rid, n in zip(request_ids, counts, strict=True) if n is not None and int(n) >= self.cap}

    def count(self, request_ids: list[str]) -> None:
        """``request_ids`` are being preempted once more."""
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.incr(COUNT_PREFIX + rid)
                    pipe.expire(COUNT_PREFIX + rid, COUNT_TTL_S)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("preemptions not counted (%s)", type(exc).__name__)
