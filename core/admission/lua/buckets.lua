-- Shared by admit.lua and release.lua: the limiter prepends this file to each when it registers
-- them, so both compute clocks and token-bucket refills the same way.

-- Milliseconds: `given` (tests drive time explicitly) or, when it is '', the Redis clock.
local function clock_ms(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A bucket holding `level` at time `t` (ms), refilled at `cap` per 60 s up to `now` and never
-- above `cap`; returns the level and the time it belongs to.
local function refill(level, t, cap, now)
  if now > t then
    level = level + (now - t) * cap / 60000
    t = now
  end
  if level > cap then level = cap end
  return level, t
end

-- Milliseconds until a bucket at `level` is full again.
local function full_ms(level, cap)
  return math.max(0, math.ceil((cap - level) * 60000 / cap))
end

