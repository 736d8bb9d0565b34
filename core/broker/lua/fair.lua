-- Fair queuing of one class queue's requests across tenants (core/broker/fair.py), in one step:
-- the puts, then as many takes as the Celery queue has room for. weight() and leave() are
-- line.lua's.
--
-- The queue's room: where the engines serving the class state theirs (KEYS 9, written as each
-- request enters or leaves an engine), as many messages as they have seats for it, so that a
-- request waits in the line, in fair order, until a seat is free for it, never in the queue
-- behind another tenant's messages; a tier served ahead of its class (priority) the seats the
-- governor would free for it (the entries' fourth figure: default work leaves for it). Where no
-- engine states its room (none serves the class yet, or none is governed), the depth (ARGV 1).
--
-- Start-time fair queuing per service tier: a request of cost c (engine seconds) from a tenant
-- of weight w starts at S = max(V, the tenant's last finish F) and finishes at F = S + c / w; the
-- line is served in order of start, and V (the tier's virtual time) is the start of the request
-- served last. A tenant that queued much has its starts far ahead of V, so a request of a tenant
-- that queued nothing starts at V and goes next; between tenants with work queued, each gets
-- engine time in proportion to its weight (a reserved share's, or 1). Tiers never mix: a tier's rank (its message priority
-- step) scales the score, so the line gives all of a better tier's requests first.
--
-- KEYS 1 the line (zset: request id → rank × RANK + start)  2 the items (hash: request id →
--        'tier tenant cost') 3 the state (hash: 'v:<tier>' the tier's virtual time,
--        'f:<tier>:<tenant>' the tenant's last finish)  4 what each tenant has in the line (hash:
--        '<tier>|<tenant>' → the engine seconds of its requests there; admit.lua reads it)
--        5 how many (hash: the same fields → requests)  6 the class's monitor snapshot (hash:
--        drain_tps, prefill_s_tok, prefill_s_tok2, engines: what a request's engine time is priced
--        at)  7 the set of queues with a line  8 the reserved shares (hash: tenant → share, synced
--        from Postgres by the load monitor)  9 the class's live room (hash: worker → 'room
--        backlog_s seq_tps ahead_room line_room', core/admission/load.py room_key: the seats
--        free for the tier ahead, and for the line: a realtime class's counts those batch work
--        holds, which yields to realtime)  10 the messages on their way (zset: '<step>:<id>' → the
--        ms they were taken: let through by a script, not yet in the queue's lists; the taker
--        removes them once published, and one older than SENDING_MS counts no more)  11.. the
--        Celery queue's lists (one per priority step)
-- ARGV 1 the depth: how many messages of a tier or a better one the Celery queue may hold for the
--        line to let that tier's next request through where no engine states its room (a priority
--        request never waits in the line behind default messages the queue holds)  2 the queue's
--        name  3 the priority step of each of KEYS 10.. (comma-separated)  4 the step of the tier
--        served ahead in this queue ('' none)  5 n puts, then per put: id, tier, rank (its step),
--        tenant, prompt tokens, output tokens
-- Several takers run at once (each engine as its seats free, the publishers, the monitor): each
-- counts what the others let through and have not pushed yet, or a burst of free seats would be
-- filled several times over, and a quiet tenant's request let through behind the extra ones.
-- Returns {id, tier, ...}: the requests taken off the line, for the caller to publish in that order.
local RANK = 1e10  -- virtual time advances at most a second per engine second: centuries apart

local snap = redis.call('HMGET', KEYS[6], 'drain_tps', 'prefill_s_tok', 'prefill_s_tok2', 'engines')
local drain = tonumber(snap[1]) or 0
local price, price2 = tonumber(snap[2]) or 0, tonumber(snap[3]) or 0
local engines = math.max(1, tonumber(snap[4]) or 1)
if drain <= 0 then drain, price, price2, engines = 1000, 0.0002, 0, 1 end

local puts = tonumber(ARGV[5])
for i = 0, puts - 1 do
  local id, tier, rank, tenant = ARGV[6 + 6 * i], ARGV[7 + 6 * i], tonumber(ARGV[8 + 6 * i]), ARGV[9 + 6 * i]
  local prompt, output = tonumber(ARGV[10 + 6 * i]) or 0, tonumber(ARGV[11 + 6 * i]) or 0
  -- Put again (the sweep, a retry), it is no longer on its way from an earlier take.
  redis.call('ZREM', KEYS[10], rank .. ':' .. id)
  -- Once only: a request published again (the sweep, a retry) keeps its place.
  if not redis.call('ZSCORE', KEYS[1], id) then
    local cost = output / drain + (prompt * price + prompt * prompt * price2) / engines
    local share, w = tonumber(redis.call('HGET', KEYS[8], tenant)) or 0, 1
    if share > 0 then  -- the other tenants with work in the tier's line
      local others, mark = 0, tier .. '|'
      for _, field in ipairs(redis.call('HKEYS', KEYS[5])) do
        if string.sub(field, 1, #mark) == mark and field ~= mark .. tenant then others = others + 1 end
      end
      w = weight(share, others)
    end
    local v = redis.call('HMGET', KEYS[3], 'v:' .. tier, 'f:' .. tier .. ':' .. tenant)
    local start = math.max(tonumber(v[1]) or 0, tonumber(v[2]) or 0)
    redis.call('HSET', KEYS[3], 'f:' .. tier .. ':' .. tenant, start + cost / w)
    redis.call('HINCRBYFLOAT', KEYS[4], tier .. '|' .. tenant, cost)
    redis.call('HINCRBY', KEYS[5], tier .. '|' .. tenant, 1)
    redis.call('HSET', KEYS[2], id, tier .. ' ' .. tenant .. ' ' .. cost)
    redis.call('ZADD', KEYS[1], rank * RANK + start, id)
  end
end
if puts > 0 then redis.call('SADD', KEYS[7], ARGV[2]) end

-- The messages waiting at each step of the queue.
local steps, waiting = {}, {}
for step in string.gmatch(ARGV[3], '[^,]+') do steps[#steps + 1] = tonumber(step) end
for k = 11, #KEYS do waiting[k - 10] = redis.call('LLEN', KEYS[k]) end
local SENDING_MS = 2000
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now_ms - SENDING_MS)
local sending = {}
for _, member in ipairs(redis.call('ZRANGE', KEYS[10], 0, -1)) do
  local step = tonumber(string.match(member, '^(%d+):'))
  if step then sending[step] = (sending[step] or 0) + 1 end
end
-- How many messages the queue may hold for a tier: the free seats the engines state, or the depth.
local seats, ahead_seats, stated = 0, 0, false
local rooms = redis.call('HVALS', KEYS[9])
for _, entry in ipairs(rooms) do
  local r, a, l = string.match(entry, '^(%S+) %S+ %S+ (%S+) ?(%S*)$')
  r = tonumber(r or entry)
  if r then
    stated = true
    seats = seats + math.max(0, tonumber(l) or r)
    ahead_seats = ahead_seats + math.max(0, tonumber(a) or r)
  end
end
local ahead_step = tonumber(ARGV[4])
local function room(rank)
  if not stated then return tonumber(ARGV[1]) end
  return rank == ahead_step and ahead_seats or seats
end
local function ahead(rank)  -- those a message at step `rank` waits behind
  local n = 0
  for j, step in ipairs(steps) do if step <= rank then n = n + (waiting[j] or 0) end end
  for step, count in pairs(sending) do if step <= rank then n = n + count end end
  return n
end
local out = {}
while true do
  local top = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #top == 0 then break end
  local id, score = top[1], tonumber(top[2])
  local rank = math.floor(score / RANK)
  -- Best tier first: once this one may not go, no later one may (a worse step waits behind more).
  if ahead(rank) >= room(rank) then break end
  redis.call('ZREM', KEYS[1], id)
  local tier = leave(KEYS[2], KEYS[4], KEYS[5], id)
  if tier then
    local vkey = 'v:' .. tier
    local start = score % RANK
    if start > (tonumber(redis.call('HGET', KEYS[3], vkey)) or 0) then redis.call('HSET', KEYS[3], vkey, start) end
  end
  out[#out + 1] = id
  out[#out + 1] = tier or ''
  redis.call('ZADD', KEYS[10], now_ms, rank .. ':' .. id)
  sending[rank] = (sending[rank] or 0) + 1
end
return out
