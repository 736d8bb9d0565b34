-- A request that ended while in its queue's fair line (cancelled, expired) leaves it, and its
-- tenant's queued engine time with it (core/broker/fair.py).
-- KEYS 1 the line  2 the items  3 the engine seconds  4 the requests (fair.lua's 1, 2, 4 and 5)
-- ARGV 1 the request id
-- Returns 1 when it was in the line.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local item = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local tier, tenant, cost = string.match(item or '', '^(%S+) (%S+) (%S+)$')
if tenant then
  local field = tier .. '|' .. tenant
  if redis.call('HINCRBY', KEYS[4], field, -1) <= 0 then
    redis.call('HDEL', KEYS[3], field)
    redis.call('HDEL', KEYS[4], field)
  else
    redis.call('HINCRBYFLOAT', KEYS[3], field, -tonumber(cost))
  end
end
return 1
