"""The Lua scripts of the shared quotas (``proxy.replicas.quotas``).

Every write to a tenant's counters is an operation with an id, recorded in the tenant's ledger
(a hash id -> state and a sorted set id -> expiry, on the tenant's Redis Cluster slot), so that
writing it again changes nothing and a reservation whose answer was lost can be undone exactly:

- ``RESERVE`` records ``r`` (reserved, open) when it charges; it charges nothing for an id
  already undone (``u``: an undo overtook it, say after a stall).
- ``APPLY`` adds a settle's correction once (``r`` -> ``s``), or a batch of charges made without
  Redis once (-> ``a``); an id it has not seen (a Redis that lost its data, a record expired) is
  applied as the corrections always were.
- ``UNDO`` takes back a reservation still open (``r`` -> ``u``), or leaves a tombstone (``u``)
  for one that never arrived, so that it charges nothing if it arrives late.

Values are checked per key before anything is written: a counter that is not a number (a
rolling upgrade, an operator's mistake) is answered as a bad key for its tenant alone, and a
ledger of the wrong type is dropped (bookkeeping: without a record, a settle corrects as it
always did and an undo takes nothing back, so a tenant is never charged less than it used).

KEYS: the ledger's hash, its expiry set, then the counters. ARGV: the operation's id, the
proxy's clock (Unix ms), the records' lifetime (ms), then the script's own. Each answer starts
``{status, bad counter or '', ledger keys reset (newline-separated) or ''}``.
"""

from __future__ import annotations

from proxy.replicas.client import Script

_LEDGER = """
local ops, due, id = KEYS[1], KEYS[2], ARGV[1]
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local reset = {}
local function kind(key) return redis.call('TYPE', key)['ok'] end
for _, want in ipairs({{ops, 'hash'}, {due, 'zset'}}) do
  local found = kind(want[1])
  if found ~= 'none' and found ~= want[2] then
    redis.call('DEL', want[1])
    reset[#reset + 1] = want[1]
  end
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, 32)) do
  redis.call('HDEL', ops, old)
  redis.call('ZREM', due, old)
end
local state = redis.call('HGET', ops, id)
local function record(value)
  redis.call('HSET', ops, id, value)
  redis.call('ZADD', due, now + ttl, id)
  redis.call('PEXPIRE', ops, ttl)
  redis.call('PEXPIRE', due, ttl)
end
-- A counter's value: a finite number, 0 when absent; nil for anything else, and for what
-- tonumber reads but INCRBYFLOAT refuses (space around it: a 5 and a newline, as
-- `redis-cli -x SET` writes), or a write would fail midway, its first counters charged, no
-- record made.
local function counter(key)
  local found = kind(key)
  if found == 'none' then return 0 end
  if found ~= 'string' then return nil end
  local raw = redis.call('GET', key)
  if string.find(raw, '^%s') or string.find(raw, '%s$') then return nil end
  local n = tonumber(raw)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end
local function first_bad()
  for i = 3, #KEYS do
    if counter(KEYS[i]) == nil then return KEYS[i] end
  end
  return nil
end
local function answer(status, bad, rest)
  local out = {status, bad or '', table.concat(reset, '\\n')}
  for _, v in ipairs(rest or {}) do out[#out + 1] = v end
  return out
end
-- Adds to the counters: ARGV from ``first`` on, per counter its amount and expiry (Unix ms).
-- A correction that would lower a key that is gone (expired, a Redis that lost its data) is
-- dropped; a bad counter is left as it is.
local function add(first, sign)
  for i = 3, #KEYS do
    local j = first + 2 * (i - 3)
    local amount = sign * tonumber(ARGV[j])
    local ok = amount > 0 or (amount < 0 and redis.call('EXISTS', KEYS[i]) == 1)
    if ok and counter(KEYS[i]) ~= nil then
      redis.call('INCRBYFLOAT', KEYS[i], tostring(amount))
      redis.call('PEXPIREAT', KEYS[i], ARGV[j + 1])
    end
  end
end
"""

# ARGV[4..]: per counter its limit, the amount asked and its expiry (Unix ms).
# All or nothing: status 1 and the counters after, when every counter stays within its limit;
# else 0 and the counters now, nothing charged. -1: a bad counter (nothing charged); -2: this
# id was undone before it arrived (nothing charged).
RESERVE = Script(
    _LEDGER
    + """
if state then return answer(-2) end
local bad = first_bad()
if bad then return answer(-1, bad) end
local used, ok = {}, 1
for i = 3, #KEYS do
  local j = 4 + 3 * (i - 3)
  used[i - 2] = counter(KEYS[i])
  local limit, amount = tonumber(ARGV[j]), tonumber(ARGV[j + 1])
  if amount > 0 and used[i - 2] + amount > limit then ok = 0 end
end
if ok == 1 then
  for i = 3, #KEYS do
    local j = 4 + 3 * (i - 3)
    used[i - 2] = tonumber(redis.call('INCRBYFLOAT', KEYS[i], ARGV[j + 1]))
    redis.call('PEXPIREAT', KEYS[i], ARGV[j + 2])
  end
  record('r')
end
local out = {}
for i, v in ipairs(used) do out[i] = tostring(v) end
return answer(ok, nil, out)
"""
)

# ARGV[4]: 'settle' (a reservation's correction) or 'add' (charges made without Redis), then per
# counter its amount and expiry (Unix ms). Status 1 (applied, or already applied: nothing
# done); -1: a bad counter, nothing done.
APPLY = Script(
    _LEDGER
    + """
local mode = ARGV[4]
if state and not (mode == 'settle' and state == 'r') then return answer(1) end
local bad = first_bad()
if bad then return answer(-1, bad) end
add(5, 1)
if mode == 'settle' then record('s') else record('a') end
return answer(1)
"""
)

# ARGV[4..]: per counter the amount reserved and its expiry (Unix ms). Status 1 always: an open
# reservation is taken back (a bad counter keeps its value: nothing there to take back from),
# an unknown one is marked so that it charges nothing when it comes, a closed one is left.
UNDO = Script(
    _LEDGER
    + """
if state == 'r' then
  add(4, -1)
  record('u')
elseif not state then
  record('u')
end
return answer(1)
"""
)
