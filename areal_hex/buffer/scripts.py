"""Lua scripts: the read-check-write steps that must be atomic on the server.

Each is run with EVALSHA (redis-py's `register_script`), so the source travels once.
"""

from __future__ import annotations

# Staleness gate + backpressure, checked and counted in one step so that concurrent
# producers can never overshoot the bound.
# KEYS: submitted, version, traj.  ARGV: n, eta, B, max_pending, serving version ('' =
# none: the published one counts). The gate counts from the older of the two: weights the
# servers have not loaded yet do not open it.
# Returns {status, submitted, version, backlog}: status 1 admitted (submitted already
# includes n), 0 blocked by the gate, -1 blocked by backpressure.
ADMIT = """
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
return {1, sub, v, backlog}
"""

# Give back admissions whose groups will never be put (never below zero).
# KEYS: submitted.  ARGV: n.  Returns the new count.
RELEASE = """
local sub = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = math.min(tonumber(ARGV[1]), sub)
return redis.call('DECRBY', KEYS[1], n)
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
