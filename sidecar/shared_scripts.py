"""The Redis scripts behind fleet-wide team limits, run atomically on the server.

One scope (a team, or a team on one replica group) has three keys, all under the same hash tag so
they live on one shard:

- ``<prefix>:{<scope>}:b`` holds the requests and tokens buckets: each level and the time it was
  last refilled. A script writes only the buckets it was given a limit for: a sidecar whose
  configuration has no tokens limit for the team (a reload half rolled out) leaves the tokens
  bucket as it is, never empties it.
- ``<prefix>:{<scope>}:c`` holds every admission in flight, as a sorted set of unique members
  scored by the end of their lease. It is the concurrency count, and it is also the receipt that
  makes settlement exactly once: a settlement or a withdrawal acts only when it removes its
  member, so sending one twice (after a timeout, not knowing whether it ran) changes nothing.
- ``<prefix>:{<scope>}:x`` holds withdrawn members: admissions whose sidecar gave up waiting
  (``UNDO`` found them not yet run). An admission that Redis runs late, after its withdrawal,
  finds its member there and does nothing. An admission that carried a debt (what its sidecar
  admitted on its own during an outage) marks its member here as well, so that a withdrawal
  sent after it never takes that debt a second time.
- ``<prefix>:{<scope>}:p`` holds the sidecars that have paid for the scope's state as Redis
  holds it: a sidecar's first admission into it takes from the buckets what that sidecar admitted
  through Redis in the last minute (nothing, for a sidecar new to the scope). Redis restarted
  empty, flushed or evicting reads lost buckets as full; the hash is lost with them, so every
  sidecar then pays, once, what the lost buckets held of it. The hash lives two minutes past the
  scope's last admission or settlement: when it expires by itself no sidecar admitted or settled
  anything in the minute before, and the payments are nothing.

Every clock reading is Redis's own ``TIME``, so sidecars with skewed clocks still share one bucket
exactly. Each key expires by itself: the buckets when they would be full again (a missing bucket
is read as full), the lease set one lease after its last admission or renewal, the withdrawn set
one lease after its last withdrawal. A sidecar that dies holding slots therefore leaks them for at
most one lease: admission drops expired members first.
"""

from __future__ import annotations

__all__ = ["ADMIT", "RENEW", "SETTLE", "UNDO"]

# Shared by the scripts. A bucket is two fields, its level and when it was last refilled; `cap`
# 0 means the caller has no such limit, and such a bucket is neither read nor written.
_BUCKETS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
-- The level of a bucket now, refilled at `cap` per minute since it was last written.
local function level(h_level, h_at, cap, now)
  if cap <= 0 then return 0 end
  local lv = tonumber(h_level)
  if lv == nil then return cap end
  local dt = math.max(0, now - (tonumber(h_at) or now))
  return math.min(cap, lv + dt * cap / 60000)
end
local function full_in_ms(lv, cap)
  if cap <= 0 then return 0 end
  return math.ceil((cap - lv) * 60000 / cap)
end
-- `amount` taken for what a sidecar admitted on its own while it could not reach Redis: at most
-- one bucket, and never below empty. A negative amount gives back, up to a full bucket.
local function debit(lv, amount, cap)
  if cap <= 0 or amount == 0 then return lv end
  if amount < 0 then return math.min(cap, lv - amount) end
  return math.max(math.min(lv, 0), lv - math.min(amount, cap))
end
local function read(key, rpm, tpm, now)
  local h = redis.call('HMGET', key, 'r', 'rt', 't', 'tt')
  return level(h[1], h[2], rpm, now), level(h[3], h[4], tpm, now)
end
-- Writes the buckets the caller has a limit for; the key lives until the emptier is full again.
-- A caller with one limit only keeps at least the time the key already had (the other bucket,
-- which it cannot see, may need longer).
local function store(key, r, rpm, tk, tpm, now)
  local at = tostring(now)
  local ttl = math.max(full_in_ms(r, rpm), full_in_ms(tk, tpm), 1000)
  if rpm > 0 and tpm > 0 then
    redis.call('HSET', key, 'r', tostring(r), 'rt', at, 't', tostring(tk), 'tt', at)
  elseif rpm > 0 then
    redis.call('HSET', key, 'r', tostring(r), 'rt', at)
    ttl = math.max(ttl, redis.call('PTTL', key))
  elseif tpm > 0 then
    redis.call('HSET', key, 't', tostring(tk), 'tt', at)
    ttl = math.max(ttl, redis.call('PTTL', key))
  else
    return
  end
  redis.call('PEXPIRE', key, ttl)
end
"""

# KEYS: buckets, in flight, withdrawn, paid. ARGV: rpm, tpm, max_concurrent (0 = none), reserve,
# member, lease_ms, owed requests, owed tokens (what the sidecar admitted on its own during its
# last outage: taken whatever the decision, and the member then marked as run, so that an UNDO
# sent after a timeout knows not to take it again), the sidecar's id, and the requests and tokens
# it admitted through Redis in the last minute (owed too when the paid hash does not hold the id:
# Redis lost the scope's state since the sidecar's last admission).
# Returns {admitted, reason (0 none, 1 concurrency, 2 requests, 3 tokens, 4 withdrawn), retry_ms,
# requests level, tokens level, in flight}; levels as strings (Lua numbers would be truncated).
ADMIT = (
    _BUCKETS
    + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, member, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local owed_r, owed_t = tonumber(ARGV[7]), tonumber(ARGV[8])
if redis.call('ZSCORE', KEYS[3], member) then
  return {0, 4, 0, '0', '0', 0}
end
if redis.call('HSETNX', KEYS[4], ARGV[9], 1) == 1 then
  owed_r, owed_t = owed_r + tonumber(ARGV[10]), owed_t + tonumber(ARGV[11])
end
redis.call('PEXPIRE', KEYS[4], 120000)
local now = now_ms()
local r, tk = read(KEYS[1], rpm, tpm, now)
local changed = owed_r ~= 0 or owed_t ~= 0
if changed then
  r, tk = debit(r, owed_r, rpm), debit(tk, owed_t, tpm)
  redis.call('ZADD', KEYS[3], now + lease, member)
  redis.call('PEXPIRE', KEYS[3], math.ceil(lease) + 1000)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local n = redis.call('ZCARD', KEYS[2])
local reason, retry = 0, 0
if conc > 0 and n >= conc then
  reason, retry = 1, 1000
elseif rpm > 0 and r < 1 then
  reason, retry = 2, math.ceil((1 - r) * 60000 / rpm)
elseif tpm > 0 and tk < math.min(reserve, tpm) then
  -- A request larger than the whole bucket passes when the bucket is full, never otherwise.
  reason, retry = 3, math.ceil((math.min(reserve, tpm) - tk) * 60000 / tpm)
end
if reason == 0 then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then tk = tk - reserve end
  redis.call('ZADD', KEYS[2], now + lease, member)
  redis.call('PEXPIRE', KEYS[2], math.ceil(lease) + 1000)
  n = n + 1
  changed = true
end
if changed then store(KEYS[1], r, rpm, tk, tpm, now) end
return {reason == 0 and 1 or 0, reason, retry, tostring(r), tostring(tk), n}
"""
)

# KEYS: buckets, in flight, withdrawn (unused), paid. ARGV: rpm, tpm, tokens to give back
# (reserved - used; negative takes more), member. Frees the slot and replaces the reservation by
# the real usage, once: a member already gone (settled, or its lease lapsed) changes nothing.
# The paid hash lives on two minutes from a settlement too, so it never expires while a sidecar
# counts a settlement of the last minute. Returns 1 when it acted, else 0.
SETTLE = (
    _BUCKETS
    + """
local rpm, tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('ZREM', KEYS[2], ARGV[4]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[4], 120000)
if tpm > 0 and delta ~= 0 then
  local now = now_ms()
  local r, tk = read(KEYS[1], rpm, tpm, now)
  store(KEYS[1], r, rpm, math.min(tpm, tk + delta), tpm, now)
end
return 1
"""
)

# KEYS: buckets, in flight, withdrawn. ARGV: rpm, tpm, reserve, member, keep_ms, owed requests,
# owed tokens. Takes back an admission whose request was never served: refused after admission,
# or sent to Redis by a sidecar that stopped waiting for the answer (a timeout, a lost
# connection, a cancelled caller). Three cases, told apart by the member:
# - it holds a slot (admitted): the slot, the request and the whole reservation go back;
# - it is marked withdrawn (it ran carrying a debt and was refused, or was withdrawn before):
#   nothing to do;
# - neither (not run yet, or run and refused carrying no debt): it is barred for keep_ms, so it
#   does nothing if Redis runs it after this, and the debt it carried is taken here instead.
# Sending it twice changes nothing more. Returns 1 when it gave back, else 0.
UNDO = (
    _BUCKETS
    + """
local rpm, tpm, reserve = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local member, keep = ARGV[4], tonumber(ARGV[5])
local owed_r, owed_t = tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
if redis.call('ZREM', KEYS[2], member) == 1 then
  local r, tk = read(KEYS[1], rpm, tpm, now)
  store(KEYS[1], math.min(rpm, r + 1), rpm, math.min(tpm, tk + reserve), tpm, now)
  return 1
end
if redis.call('ZSCORE', KEYS[3], member) then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], now + keep, member)
redis.call('PEXPIRE', KEYS[3], math.ceil(keep) + 1000)
if owed_r ~= 0 or owed_t ~= 0 then
  local r, tk = read(KEYS[1], rpm, tpm, now)
  store(KEYS[1], debit(r, owed_r, rpm), rpm, debit(tk, owed_t, tpm), tpm, now)
end
return 0
"""
)

# KEYS: in flight. ARGV: lease_ms, members... Extends the lease of the slots this sidecar holds.
RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1000)
return 1
"""
