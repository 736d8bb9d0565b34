-- A request that ended while in its queue's fair line (cancelled, expired) leaves it, and its
-- tenant's queued engine time with it (core/broker/fair.py; leave() is line.lua's).
-- KEYS 1 the line  2 the items  3 the engine seconds  4 the requests (fair.lua's 1, 2, 4 and 5)
-- ARGV 1 the request id
-- Returns 1 when it was in the line.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
leave(KEYS[2], KEYS[3], KEYS[4], ARGV[1])
return 1
