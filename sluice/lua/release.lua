-- Give back what a finished request did not use, exactly once. Its in-flight member is the
-- marker: only the call that removes it refunds, so retried and duplicate releases are no-ops.
--
-- KEYS  1 platform bucket (hash)  2 tenant buckets (hash)  3 tenant in-flight (zset)
-- ARGV  1 request id  2 refund in tokens (reserved - used; negative charges use beyond the
--       reservation)  3 now in ms ('' = the Redis clock)
-- Returns 1 if this call released the request, 0 if it was not in flight (already released).

if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end
local refund = tonumber(ARGV[2])
if refund == 0 then return 1 end

local now
if ARGV[3] ~= '' then
  now = tonumber(ARGV[3])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local v = redis.call('HMGET', key, 'tok', 'tok_t', 'tok_cap')
  local level, t, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  -- A missing bucket has refilled completely, so there is nothing to give back to it.
  if level and t and cap then
    if now > t then
      level = level + (now - t) * cap / 60000
      t = now
    end
    if level > cap then level = cap end
    level = math.min(cap, level + refund)
    redis.call('HSET', key, 'tok', level, 'tok_t', t)
    local full = math.max(0, math.ceil((cap - level) * 60000 / cap)) + 60000
    redis.call('PEXPIRE', key, math.max(redis.call('PTTL', key), full))
  end
end
return 1
