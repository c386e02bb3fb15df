"""The Lua scripts: each limit decision is one script, so it is atomic across replicas (Redis
runs one script at a time). Time is Redis's own ``TIME``: one clock for every replica, so a
``Retry-After`` computed here is exact whichever replica asks. Bucket levels may be fractional
and are returned as strings (Lua numbers come back as integers otherwise)."""

from __future__ import annotations

from proxy.replicas.client import Script

# A token bucket in a hash {level, at}; an absent key is a full bucket. Mirrors
# proxy.scheduling.limits.TokenBucket
# (capacity = per minute, refilled at per minute / 60 per second), debt floor included: the
# level never goes below -capacity, so one huge answer costs a tenant at most one minute of its
# limit (a Retry-After of at most ~60 s plus its own request), not hours.
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- A key of the wrong type or format (a rolling upgrade, an operator's mistake) is reset: a full
-- bucket, an empty lease set, as after a Redis restart (the renewals rebuild the leases within
-- a second). Returned, newline-separated, to be counted and logged; other tenants never see it.
local reset = {}
local function check(key, want)
  local found = redis.call('TYPE', key)['ok']
  local ok = found == 'none' or found == want
  if ok and found == 'hash' then
    local v = redis.call('HMGET', key, 'level', 'at')
    local lvl, at = tonumber(v[1]), tonumber(v[2])
    ok = lvl ~= nil and at ~= nil and lvl == lvl and at == at
      and math.abs(lvl) ~= math.huge and math.abs(at) ~= math.huge
  end
  if not ok then
    redis.call('DEL', key)
    reset[#reset + 1] = key
  end
end
local function level(key, per_min)
  local v = redis.call('HMGET', key, 'level', 'at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then return per_min end
  if now > at then lvl = lvl + (now - at) * per_min / 60 end
  -- The debt floor also caps a level stored before there was one.
  return math.max(-per_min, math.min(per_min, lvl))
end
local function store(key, per_min, lvl)
  lvl = math.max(-per_min, lvl)
  redis.call('HSET', key, 'level', tostring(lvl), 'at', tostring(now))
  -- Once refilled the key says nothing an absent key would not: let it go then.
  local full_in_ms = math.ceil((per_min - lvl) / (per_min / 60) * 1000) + 1000
  redis.call('PEXPIRE', key, full_in_ms)
end
"""

# KEYS: rpm bucket, tpm bucket, concurrency set (member -> lease expiry)
# ARGV: rpm per minute (0: none), tpm per minute (0: none), tokens, max concurrent (0: none),
#       member, lease ttl (s)
# Returns {1, "0", "", rpm level, tpm level, keys reset} (levels after the take; "" where no
# such limit) or {0, retry after seconds, the limit that said no, "", "", keys reset}. All or
# nothing.
ADMIT = Script(
    _BUCKET
    + """
check(KEYS[1], 'hash')
check(KEYS[2], 'hash')
check(KEYS[3], 'zset')
local done = table.concat(reset, '\\n')
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens, max_conc = tonumber(ARGV[3]), tonumber(ARGV[4])
local ttl = tonumber(ARGV[6])
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)  -- leases nobody renewed
  if redis.call('ZCARD', KEYS[3]) >= max_conc then
    -- frees when a request ends: no clock says when
    return {0, '1', 'max_concurrent', '', '', done}
  end
end
local wait, which = 0, ''
local rl, tl
if rpm > 0 then
  rl = level(KEYS[1], rpm)
  local w = (math.min(1, rpm) - rl) / (rpm / 60)
  if w > wait then wait, which = w, 'requests_per_minute' end
end
if tpm > 0 then
  tl = level(KEYS[2], tpm)
  -- A request bigger than the whole bucket waits for a full bucket, then goes.
  local w = (math.min(tokens, tpm) - tl) / (tpm / 60)
  if w > 0 and w >= wait then wait, which = w, 'tokens_per_minute' end
end
if wait > 0 then return {0, tostring(wait), which, '', '', done} end
local out = {1, '0', '', '', '', done}
if rpm > 0 then
  store(KEYS[1], rpm, rl - 1)
  out[4] = tostring(math.max(-rpm, rl - 1))
end
if tpm > 0 then
  store(KEYS[2], tpm, tl - tokens)
  out[5] = tostring(math.max(-tpm, tl - tokens))
end
if max_conc > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * 1000) + 1000)
end
return out
"""
)

# KEYS: tpm bucket, concurrency set
# ARGV: tpm per minute (0: none), reserved tokens, used tokens (-1: unknown), member
# The request ended: its concurrency lease goes, the unused reservation comes back and usage
# past it is debited (the bucket may go below zero, as the local one does).
SETTLE = Script(
    _BUCKET
    + """
check(KEYS[1], 'hash')
check(KEYS[2], 'zset')
redis.call('ZREM', KEYS[2], ARGV[4])
local tpm, reserved, used = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and used >= 0 and used ~= reserved then
  local lvl = level(KEYS[1], tpm)
  if used < reserved then lvl = math.min(tpm, lvl + reserved - used)
  else lvl = lvl - (used - reserved) end
  store(KEYS[1], tpm, lvl)
end
return 1
"""
)

# KEYS: concurrency sets; ARGV: lease ttl (s), then one member per key.
# Renews the leases of a replica's running requests (re-adds one that expired while the
# replica was cut off: the count must say what really runs).
RENEW = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] ~= 'zset' then redis.call('DEL', key) end  -- as ADMIT's
  redis.call('ZADD', key, now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', key, math.ceil(ttl * 1000) + 1000)
end
return #KEYS
"""
)

# KEYS: the hash tenant -> virtual token counter (global)
# ARGV: n, then n triples (tenant, service charged since the last merge, its counter here),
#       then the tenants whose counter the caller wants back.
# A counter is the sum of every replica's charges, and at least any replica's own counter (a
# replica lifts a tenant returning from idle: the lift must hold everywhere). Returns
# {tenant, counter, ...} for the charged and the asked tenants.
VTC_MERGE = Script(
    """
local n = tonumber(ARGV[1])
local out = {}
for i = 0, n - 1 do
  local tenant, delta, here = ARGV[2 + 3 * i], tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i])
  local merged = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], tenant, delta))
  if here > merged then
    merged = here
    redis.call('HSET', KEYS[1], tenant, tostring(here))
  end
  out[#out + 1] = tenant
  out[#out + 1] = tostring(merged)
end
for i = 2 + 3 * n, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    out[#out + 1] = ARGV[i]
    out[#out + 1] = v
  end
end
return out
"""
)

# Backend room metered by several replicas: KEYS[1] a hash replica -> slots held, KEYS[2] a
# sorted set replica -> heartbeat expiry. A replica that stops renewing (crashed) loses its
# slots at the next call of any replica once its heartbeat expired.
_ROOM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local replica, ttl = ARGV[1], tonumber(ARGV[2])
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], r)
  redis.call('ZREM', KEYS[2], r)
end
redis.call('ZADD', KEYS[2], now + ttl, replica)
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000) + 1000)
"""

# ARGV: replica, ttl, want, room (max_inflight), reserve, better (1: best tier waits here),
# held (the slots the replica holds before this call, as it counts them). Returns {granted,
# seconds until another replica's heartbeat expires (room may appear then without a message),
# live replicas}. Want 0 renews the heartbeat only. The replica's entry is SET to held +
# granted, never incremented: a call whose answer was lost (a stall past call_timeout_s, after
# which the script still ran) is overwritten by the next one, not kept as slots nobody holds.
ROOM_ACQUIRE = Script(
    _ROOM
    + """
local want, room, reserve = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local held = tonumber(ARGV[7])
local total = held
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  if entries[i] ~= replica then total = total + (tonumber(entries[i + 1]) or 0) end
end
local cap = room
if ARGV[6] == '1' then cap = room + reserve end
local grant = math.max(0, math.min(want, cap - total))
if held + grant > 0 then
  redis.call('HSET', KEYS[1], replica, held + grant)
else
  redis.call('HDEL', KEYS[1], replica)
end
local retry = ttl
local first = redis.call('ZRANGE', KEYS[2], 0, 1, 'WITHSCORES')
for i = 1, #first, 2 do
  if first[i] ~= replica then
    retry = math.max(0, tonumber(first[i + 1]) - now)
    break
  end
end
return {grant, tostring(retry), redis.call('ZCARD', KEYS[2])}
"""
)

# ARGV: replica, ttl, slots given back, channel, backend url, held (what the replica holds
# after it: its entry is set to it, as in ROOM_ACQUIRE). Wakes replicas waiting for room.
ROOM_RELEASE = Script(
    _ROOM
    + """
local left = tonumber(ARGV[6])
if left > 0 then
  redis.call('HSET', KEYS[1], replica, left)
else
  redis.call('HDEL', KEYS[1], replica)
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return left
"""
)

# LoRA adapter slots of one engine claimed by several replicas (proxy.replicas.adapter_claims):
# KEYS[1] a hash replica -> JSON list of the adapters it claims there, KEYS[2] a sorted set
# replica -> heartbeat expiry (a replica that stops renewing loses its claims at the next call
# of any replica once it expired). ARGV: replica, ttl, max_loras, channel ('': no message),
# backend url, JSON {keep, want, idle}: ``keep`` (in flight there: always kept, even past
# max_loras after Redis came back), then ``want`` and ``idle`` in that order, each kept while
# the distinct adapters claimed by all live replicas stay within max_loras; one another replica
# claims takes no new slot. The entry is SET to the result (never merged: a call whose answer
# was lost is overwritten by the next). Returns {JSON of the adapters claimed, JSON of those
# the others claim, seconds until another claiming replica's heartbeat expires, replicas}.
ADAPTER_CLAIM = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local replica, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], r)
  redis.call('ZREM', KEYS[2], r)
end
local others, other_list, n = {}, {}, 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  if entries[i] ~= replica then
    for _, name in ipairs(cjson.decode(entries[i + 1])) do
      if not others[name] then
        others[name] = true
        n = n + 1
        table.insert(other_list, name)
      end
    end
  end
end
local ask = cjson.decode(ARGV[6])
local mine, list = {}, {}
local function take(name, always)
  if mine[name] then return end
  if not (always or others[name] or n < cap) then return end
  mine[name] = true
  table.insert(list, name)
  if not others[name] then n = n + 1 end
end
for _, name in ipairs(ask.keep) do take(name, true) end
for _, name in ipairs(ask.want) do take(name, false) end
for _, name in ipairs(ask.idle) do take(name, false) end
if #list > 0 then
  redis.call('HSET', KEYS[1], replica, cjson.encode(list))
  redis.call('ZADD', KEYS[2], now + ttl, replica)
else
  redis.call('HDEL', KEYS[1], replica)
  redis.call('ZREM', KEYS[2], replica)
end
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000) + 1000)
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], 'freed ' .. ARGV[5]) end
local retry = ttl
local first = redis.call('ZRANGE', KEYS[2], 0, 1, 'WITHSCORES')
for i = 1, #first, 2 do
  if first[i] ~= replica then
    retry = math.max(0, tonumber(first[i + 1]) - now)
    break
  end
end
return {cjson.encode(list), cjson.encode(other_list), tostring(retry), redis.call('ZCARD', KEYS[2])}
"""
)
