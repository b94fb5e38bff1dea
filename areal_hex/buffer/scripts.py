"""Lua scripts: the read-check-write steps that must be atomic on the server.

Each is run with EVALSHA (redis-py's `register_script`), so the source travels once.
"""

from __future__ import annotations

# Staleness gate + backpressure, checked and counted in one step so that concurrent
# producers can never overshoot the bound. Admissions are held by a holder (one producer
# incarnation) until put or released; a holder whose heartbeat key has expired died with
# them, so they are first given back (reclaimed): a crash cannot leak the gate.
# KEYS: submitted, version, traj, leases, this holder's heartbeat.  ARGV: n, eta, B,
# max_pending, serving version ('' = none: the published one counts), holder, lease TTL
# in ms, heartbeat key prefix. The gate counts from the older of the two versions: weights
# the servers have not loaded yet do not open it.
# Returns {status, submitted, version, backlog}: status 1 admitted (submitted already
# includes n), 0 blocked by the gate, -1 blocked by backpressure.
ADMIT = """
local held = redis.call('HGETALL', KEYS[4])
for i = 1, #held, 2 do
  local who = held[i]
  if who ~= ARGV[6] and redis.call('EXISTS', ARGV[8] .. who) == 0 then
    local sub0 = tonumber(redis.call('GET', KEYS[1]) or '0')
    redis.call('DECRBY', KEYS[1], math.min(tonumber(held[i + 1]), sub0))
    redis.call('HDEL', KEYS[4], who)
  end
end
redis.call('SET', KEYS[5], '1', 'PX', ARGV[7])
local n = tonumber(ARGV[1])
local sub = tonumber(redis.call('GET', KEYS[1]) or '0')
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  v = math.min(v, tonumber(ARGV[5]))
end
local cap = (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local backlog = redis.call('XLEN', KEYS[3])
if sub + n > cap then
  return {0, sub, v, backlog}
end
if backlog >= tonumber(ARGV[4]) then
  return {-1, sub, v, backlog}
end
sub = redis.call('INCRBY', KEYS[1], n)
redis.call('HINCRBY', KEYS[4], ARGV[6], n)
return {1, sub, v, backlog}
"""

# The holder no longer holds n admissions (never below zero): `give_back` 1 also takes
# them off the count (their groups will never be put), 0 only ends the hold (put).
# KEYS: submitted, leases.  ARGV: n, holder, give_back.  Returns the new count.
RELEASE = """
local n = tonumber(ARGV[1])
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if held <= n then
  redis.call('HDEL', KEYS[2], ARGV[2])
else
  redis.call('HINCRBY', KEYS[2], ARGV[2], -n)
end
local sub = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[3] == '1' then
  sub = redis.call('DECRBY', KEYS[1], math.min(n, sub))
end
return sub
"""

# Acknowledge and delete trained entries (acked data is never read again, so the stream
# only holds unconsumed and pending entries), counting only entries acked for the first
# time. KEYS: traj, acked.  ARGV: group, id...  Returns how many were newly acked.
ACK_DELETE = """
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
redis.call('INCRBY', KEYS[2], n)
return n
"""

# Resume after a restart: set the version and restore the admission count to at least
# version * B, so the gate does not open wider than it was.
# KEYS: version, weights_path, submitted.  ARGV: version, path, B.
RESTORE = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
local floor = tonumber(ARGV[1]) * tonumber(ARGV[3])
local sub = tonumber(redis.call('GET', KEYS[3]) or '0')
if sub < floor then
  redis.call('SET', KEYS[3], floor)
  sub = floor
end
return sub
"""

# Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK, 8000): ack in chunks.
MAX_IDS_PER_CALL = 1000
