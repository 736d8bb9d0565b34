-- Give back what a finished request did not use, exactly once. Its in-flight member is the
-- marker: only the call that removes it refunds, so retried and duplicate releases are no-ops.
--
-- KEYS  1 platform bucket (hash)  2 tenant buckets (hash)  3 tenant in-flight (zset)
--       4 the budget charge records (hash: request id → 'unit amount counter;…', admit.lua's)
-- ARGV  1 request id  2 refund in tokens (reserved - used; negative charges use beyond the
--       reservation)  3 now in ms ('' = the Redis clock)  4 what it used in tokens
--       5 what it used in micro-dollars (4 and 5: what a hard budget keeps of its reservation)
-- Returns 1 if this call released the request, 0 if it was not in flight (already released).

if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end

-- Each hard budget it was charged to keeps what it used and gets the rest of its reservation
-- back (a counter gone with its window has nothing to give back to).
local record = redis.call('HGET', KEYS[4], ARGV[1])
if record then
  redis.call('HDEL', KEYS[4], ARGV[1])
  for unit, amount, counter in string.gmatch(record, '([^; ]+) ([^; ]+) ([^; ]+)') do
    local used = tonumber(ARGV[4]) or 0
    if unit == 'usd' then used = tonumber(ARGV[5]) or 0 end
    local back = tonumber(amount) - used
    if back ~= 0 and redis.call('EXISTS', counter) == 1 then redis.call('INCRBY', counter, -back) end
  end
end
local refund = tonumber(ARGV[2])
if refund == 0 then return 1 end

-- clock_ms, refill and full_ms come from buckets.lua, prepended at registration.
local now = clock_ms(ARGV[3])

for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local v = redis.call('HMGET', key, 'tok', 'tok_t', 'tok_cap')
  local level, t, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  -- A missing bucket has refilled completely, so there is nothing to give back to it.
  if level and t and cap then
    level, t = refill(level, t, cap, now)
    level = math.min(cap, level + refund)
    redis.call('HSET', key, 'tok', level, 'tok_t', t)
    redis.call('PEXPIRE', key, math.max(redis.call('PTTL', key), full_ms(level, cap) + 60000))
  end
end
return 1
