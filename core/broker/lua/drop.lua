-- A request that ended while in its queue's fair line (cancelled, expired) leaves it, and its
-- tenant's queued engine time with it (core/broker/fair.py).
-- KEYS 1 the line  2 the items  3 the state (fair.lua's)   ARGV 1 the request id
-- Returns 1 when it was in the line.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local item = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local tier, tenant, cost = string.match(item or '', '^(%S+) (%S+) (%S+)$')
if tenant then
  if redis.call('HINCRBY', KEYS[3], 'n:' .. tenant, -1) <= 0 then
    redis.call('HDEL', KEYS[3], 'n:' .. tenant, 'c:' .. tenant)
  else
    redis.call('HINCRBYFLOAT', KEYS[3], 'c:' .. tenant, -tonumber(cost))
  end
end
return 1
