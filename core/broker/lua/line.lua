-- What the fair lines' scripts share (core/broker/fair.py prepends it to fair.lua and drop.lua,
-- core/admission/limiter.py to admit.lua).

-- A tenant's weight in a line: 1, or for a reserved share r, r/(1 − r) times the other tenants
-- with work there (at least 1), which gives it r of the engines while they all have work; a
-- tenant whose equal turn is more keeps it. (core/broker/fair.py weight: the same, for views.)
local function weight(share, others)
  if share and share > 0 and share < 1 then return math.max(1, share / (1 - share) * math.max(1, others)) end
  return 1
end

-- Take request `id`'s item out of a line's items hash and its engine seconds and count out of its
-- tenant's fields in the seconds and counts hashes (fields '<tier>|<tenant>', deleted at none
-- left). Returns its tier, tenant and cost; nil when it had no item.
local function leave(items, seconds, counts, id)
  local item = redis.call('HGET', items, id)
  redis.call('HDEL', items, id)
  local tier, tenant, cost = string.match(item or '', '^(%S+) (%S+) (%S+)$')
  if not tier then return nil end
  local field = tier .. '|' .. tenant
  if redis.call('HINCRBY', counts, field, -1) <= 0 then
    redis.call('HDEL', seconds, field)
    redis.call('HDEL', counts, field)
  else
    redis.call('HINCRBYFLOAT', seconds, field, -tonumber(cost))
  end
  return tier, tenant, cost
end
