"""The Redis scripts behind fleet-wide team limits, run atomically on the server.

One scope (a team, or a team on one replica group) has two keys, both under the same hash tag so
they live on one shard: ``<prefix>:{<scope>}:b`` holds the requests and tokens buckets (levels and
the time they were last refilled), ``<prefix>:{<scope>}:c`` the admitted requests as a sorted set
scored by the end of their lease. Every clock reading is Redis's own ``TIME``, so sidecars with
skewed clocks still share one bucket exactly.

Each key expires by itself: the buckets when they would be full again (a missing bucket is read
as full), the lease set one lease after its last admission or renewal. A sidecar that dies
holding slots therefore leaks them for at most one lease: admission drops expired members first.
"""

from __future__ import annotations

__all__ = ["ADMIT", "RENEW", "SETTLE"]

# The refill shared by the scripts: level after `dt` ms at `cap` per minute, capped at `cap`.
_REFILL = """
local function refill(level, cap, dt)
  if cap <= 0 then return 0 end
  if level == nil then return cap end
  return math.min(cap, level + dt * cap / 60000)
end
local function full_in_ms(level, cap)
  if cap <= 0 then return 0 end
  return math.ceil((cap - level) * 60000 / cap)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local function store(key, r, rpm, tk, tpm, now)
  redis.call('HSET', key, 'r', tostring(r), 't', tostring(tk), 'u', tostring(now))
  local ttl = math.max(full_in_ms(r, rpm), full_in_ms(tk, tpm), 1000)
  redis.call('PEXPIRE', key, ttl)
end
"""

# KEYS: buckets, leases. ARGV: rpm, tpm, max_concurrent (0 = none), reserve, member, lease_ms,
# drain (1 after an outage: the fleet served on local limits meanwhile, so the shared buckets
# start empty instead of full, and refill at the limit from there: no burst on recovery).
# Returns {admitted, reason (0 none, 1 concurrency, 2 requests, 3 tokens), retry_ms,
# requests level, tokens level, in flight}; levels as strings (Lua numbers would be truncated).
ADMIT = (
    _REFILL
    + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, member, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local now = now_ms()
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'u')
local dt = math.max(0, now - (tonumber(h[3]) or now))
local r = refill(tonumber(h[1]), rpm, dt)
local tk = refill(tonumber(h[2]), tpm, dt)
if ARGV[7] == '1' then
  r = math.min(r, 0)
  tk = math.min(tk, 0)
  store(KEYS[1], r, rpm, tk, tpm, now)
end
local n = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  n = redis.call('ZCARD', KEYS[2])
  if n >= conc then
    return {0, 1, 1000, tostring(r), tostring(tk), n}
  end
end
if rpm > 0 and r < 1 then
  return {0, 2, math.ceil((1 - r) * 60000 / rpm), tostring(r), tostring(tk), n}
end
if tpm > 0 then
  -- A request larger than the whole bucket passes when the bucket is full, never otherwise.
  local need = math.min(reserve, tpm)
  if tk < need then
    return {0, 3, math.ceil((need - tk) * 60000 / tpm), tostring(r), tostring(tk), n}
  end
  tk = tk - reserve
end
if rpm > 0 then r = r - 1 end
if rpm > 0 or tpm > 0 then store(KEYS[1], r, rpm, tk, tpm, now) end
if conc > 0 then
  redis.call('ZADD', KEYS[2], now + lease, member)
  redis.call('PEXPIRE', KEYS[2], math.ceil(lease) + 1000)
  n = n + 1
end
return {1, 0, 0, tostring(r), tostring(tk), n}
"""
)

# KEYS: buckets, leases. ARGV: rpm, tpm, tokens to give back (reserved - used; negative takes
# more), member. Frees the concurrency slot and replaces the reservation by the real usage.
SETTLE = (
    _REFILL
    + """
local rpm, tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
if tpm > 0 and delta ~= 0 then
  local now = now_ms()
  local h = redis.call('HMGET', KEYS[1], 'r', 't', 'u')
  local dt = math.max(0, now - (tonumber(h[3]) or now))
  local r = refill(tonumber(h[1]), rpm, dt)
  local tk = math.min(tpm, refill(tonumber(h[2]), tpm, dt) + delta)
  store(KEYS[1], r, rpm, tk, tpm, now)
end
return 1
"""
)

# KEYS: leases. ARGV: lease_ms, members... Extends the lease of the slots this sidecar holds.
RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1000)
return 1
"""
