"""Lua scripts: the read-check-write steps that must be atomic on the server.

Each is run with EVALSHA (redis-py's `register_script`), so the source travels once, but
for PUT_LEDGER and PUT_LEASE: they run inside a MULTI/EXEC after an XADD, where a script
the server has lost (a restart) would fail after the XADD had run, so they are sent whole
(EVAL; small).
"""

from __future__ import annotations

# Give back the admissions of holders whose heartbeat key has expired (they died holding
# them), counting them as reclaimed. Expects: sub_key, leases_key, reclaimed_key, prefix
# (of heartbeat keys), me (a holder never reclaimed here; '' = none).
_RECLAIM = """
local function reclaim(sub_key, leases_key, reclaimed_key, prefix, me)
  local held = redis.call('HGETALL', leases_key)
  for i = 1, #held, 2 do
    local who = held[i]
    if who ~= me and redis.call('EXISTS', prefix .. who) == 0 then
      local sub0 = tonumber(redis.call('GET', sub_key) or '0')
      local n = math.min(tonumber(held[i + 1]), sub0)
      redis.call('DECRBY', sub_key, n)
      redis.call('INCRBY', reclaimed_key, n)
      redis.call('HDEL', leases_key, who)
    end
  end
end
"""

# Staleness gate + backpressure, checked and counted in one step so that concurrent
# producers can never overshoot the bound. Admissions are held by a holder (one producer
# incarnation) until put or given back; a holder whose heartbeat key has expired died with
# them, so they are first given back (reclaimed): a crash cannot leak the gate.
# `submitted` is the gate's count (put + held); `admitted` counts every admission ever
# made and is the data position (the controller's next prompt is number `admitted`).
# KEYS: submitted, version, traj, leases, this holder's heartbeat, admitted, reclaimed.
# ARGV: n, eta, B, max_pending, serving version ('' = none: the published one counts),
# holder, lease TTL in ms, heartbeat key prefix. The gate counts from the older of the two
# versions: weights the servers have not loaded yet do not open it.
# Returns {status, submitted, version, backlog, admitted}: status 1 admitted (submitted
# and admitted already include n), 0 blocked by the gate, -1 blocked by backpressure.
ADMIT = (
    _RECLAIM
    + """
reclaim(KEYS[1], KEYS[4], KEYS[7], ARGV[8], ARGV[6])
redis.call('SET', KEYS[5], '1', 'PX', ARGV[7])
local n = tonumber(ARGV[1])
local sub = tonumber(redis.call('GET', KEYS[1]) or '0')
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  v = math.min(v, tonumber(ARGV[5]))
end
local cap = (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local backlog = redis.call('XLEN', KEYS[3])
local admitted = tonumber(redis.call('GET', KEYS[6]) or '0')
if sub + n > cap then
  return {0, sub, v, backlog, admitted}
end
if backlog >= tonumber(ARGV[4]) then
  return {-1, sub, v, backlog, admitted}
end
sub = redis.call('INCRBY', KEYS[1], n)
admitted = redis.call('INCRBY', KEYS[6], n)
redis.call('HINCRBY', KEYS[4], ARGV[6], n)
return {1, sub, v, backlog, admitted}
"""
)

# The holder no longer holds n admissions (never below zero). With a reason (ARGV[3] one
# of keys.GIVE_BACK_REASONS) they are also taken off the gate's count and counted under
# that reason (their groups will never be put); without ('') the groups were put.
# KEYS: submitted, leases, the reason's counter.  ARGV: n, holder, reason.
# Returns the new count.
RELEASE = """
local n = tonumber(ARGV[1])
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if held <= n then
  redis.call('HDEL', KEYS[2], ARGV[2])
else
  redis.call('HINCRBY', KEYS[2], ARGV[2], -n)
end
local sub = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[3] ~= '' then
  local k = math.min(n, sub)
  sub = redis.call('DECRBY', KEYS[1], k)
  redis.call('INCRBY', KEYS[3], k)
end
return sub
"""

# End one admission of a holder's lease (never below zero): the group it was for is put.
# Expects: leases_key, holder.
_END_ONE = """
local function end_one(leases_key, holder)
  if redis.call('HINCRBY', leases_key, holder, -1) <= 0 then
    redis.call('HDEL', leases_key, holder)
  end
end
"""

# Put one admitted group whose caller gave it a put token, in one MULTI/EXEC with the XADD
# that appends it (XADD first, this script right after: nothing runs between them, so the
# stream's newest entry is that group's). The payload never passes through Lua: a 100 kB
# script argument costs the server more than the XADD itself. The script ends one
# admission of the holder's lease and records the put token with the entry id, once per
# token: when the token is already there (a retry of a put whose reply was lost, in
# whatever order the two ran), the entry just added is deleted again and the first
# append's id returned.
# The entry id is read from the helper consumer group `tip`, moved to the stream's end
# ('$'): reading the newest entry itself would bring its payload into Lua.
# KEYS: traj, leases, token key.  ARGV: holder, token TTL in s, helper group name.
# Returns the entry id.
PUT_LEDGER = (
    _END_ONE
    + """
local traj, tip = KEYS[1], ARGV[3]
if not pcall(redis.call, 'XGROUP', 'SETID', traj, tip, '$') then
  redis.call('XGROUP', 'CREATE', traj, tip, '$')
end
local id
for _, g in ipairs(redis.call('XINFO', 'GROUPS', traj)) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == tip then id = f['last-delivered-id'] end
end
local done = redis.call('GET', KEYS[3])
if done then
  redis.call('XDEL', traj, id)
  return done
end
end_one(KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], id, 'EX', ARGV[2])
return id
"""
)

# PUT_LEDGER for a put without a caller's token, after its XADD in the same MULTI/EXEC.
# Its token is the producer's own, fresh (`<holder>-<seq>`): no retry can name it, so no
# entry id is looked up (the caller has XADD's reply); the key records that the put was
# made (the run ledger counts prompts produced twice by these names) and holds 1.
# XLEN fails, leaving the lease as it was, when the XADD before could not append (the key
# is not a stream). KEYS: traj, leases, token key.  ARGV: holder, token TTL in s.
PUT_LEASE = (
    _END_ONE
    + """
redis.call('XLEN', KEYS[1])
end_one(KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], 1, 'EX', ARGV[2])
return 1
"""
)

# Reclaim what dead holders held, then report the durable position of production.
# KEYS: submitted, leases, reclaimed, admitted, then counters read as they are (one
# given-back counter per reason, groups_dropped_stale). ARGV: heartbeat key prefix.
# Returns {admitted, held by live holders, each counter...}.
POSITION = (
    _RECLAIM
    + """
reclaim(KEYS[1], KEYS[2], KEYS[3], ARGV[1], '')
local held = 0
local vals = redis.call('HVALS', KEYS[2])
for i = 1, #vals do held = held + tonumber(vals[i]) end
local out = {tonumber(redis.call('GET', KEYS[4]) or '0'), held}
for i = 5, #KEYS do out[#out + 1] = tonumber(redis.call('GET', KEYS[i]) or '0') end
return out
"""
)

# Acknowledge and delete trained entries (acked data is never read again, so the stream
# only holds unconsumed and pending entries), counting only entries acked for the first
# time. KEYS: traj, acked.  ARGV: group, id...  Returns how many were newly acked.
ACK_DELETE = """
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
redis.call('INCRBY', KEYS[2], n)
return n
"""

# Resume after a restart: set the version and recompute the gate's count from durable
# state: every group put and still counted is acked, dead-lettered or still in the stream
# (groups dropped as stale were handed back), and the rest is held by live holders (dead
# ones are reclaimed first). It is also raised to at least version * B (a server that
# lost its data must not open the gate wider than the bound), and the data position to
# at least the checkpoint's.
# The lineage is bumped: versions published from now on follow the restored one, even
# when it is lower than what was published before (a trainer that lost its newest).
# KEYS: version, weights_path, submitted, leases, reclaimed, acked, groups_dropped_stale,
# dead_count, traj, admitted, lineage.  ARGV: version, path, B, heartbeat key prefix,
# position.  Returns {submitted, the count it replaced, lineage}.
RESTORE = (
    _RECLAIM
    + """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
reclaim(KEYS[3], KEYS[4], KEYS[5], ARGV[4], '')
local held = 0
local vals = redis.call('HVALS', KEYS[4])
for i = 1, #vals do held = held + tonumber(vals[i]) end
local count = held + redis.call('XLEN', KEYS[9])
for _, i in ipairs({6, 8}) do count = count + tonumber(redis.call('GET', KEYS[i]) or '0') end
count = math.max(count, tonumber(ARGV[1]) * tonumber(ARGV[3]))
local before = tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('SET', KEYS[3], count)
local pos = tonumber(redis.call('GET', KEYS[10]) or '0')
if pos < tonumber(ARGV[5]) then
  redis.call('SET', KEYS[10], ARGV[5])
end
return {count, before, redis.call('INCR', KEYS[11])}
"""
)

# Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK, 8000): ack in chunks.
MAX_IDS_PER_CALL = 1000
