"""Lua scripts of the Redis lease store.

Key layout (every key is fixed per shard, resource names are only hash fields and set members,
so no user input ever becomes part of a lease key name or pattern)::

    <prefix>{NN}:leases    hash   resource -> "<token> <fence> <acquired_us> <expires_us> <label>"
    <prefix>{NN}:expiry    zset   resource -> expires_us (the expiry index)
    <prefix>{NN}:fences    hash   resource -> last fence issued (no TTL, never reset)
    <prefix>{NN}:epoch     string server time (us) when this shard's data was first written

``<prefix>gate:<key>`` strings hold a FenceGate's highest admitted fence per side-effect key;
the key is validated by the resource-name rule (no braces, globs or spaces) before it is used.

``NN`` is the resource's shard (crc32 of the name modulo the shard count). ``{NN}`` is the hash
tag, so a resource's keys share one Redis Cluster slot. Times are microseconds of the server's
``TIME``. A fence is ``max(last fence + 1, server time in us)``: strictly increasing, and still
greater than anything issued before if the server lost its data (restart without persistence),
as long as the server clock does not step back.
"""

from __future__ import annotations

# Shared Lua prelude: server time in microseconds and the record codec.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function fmt(n) return string.format('%.0f', n) end
local function parse(rec)
  return string.match(rec, '^(%x+) (%d+) (%d+) (%d+) (.*)$')
end
"""

ACQUIRE = (
    """
-- KEYS[1] leases hash, KEYS[2] expiry zset, KEYS[3] fences hash, KEYS[4] epoch
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] owner label, ARGV[4] ttl (us)
-- returns {1, fence, acquired_us, expires_us, epoch, prev_label|nil, prev_fence|nil}
--      or {0, holder_label, holder_fence, holder_expires_us, now_us, epoch}
"""
    + _PRELUDE
    + """
local epoch = redis.call('GET', KEYS[4])
if not epoch then
  epoch = fmt(now)
  redis.call('SET', KEYS[4], epoch)
end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local prev_label, prev_fence = false, false
if cur then
  local tok, f, a, e, label = parse(cur)
  if tonumber(e) > now then
    if tok == ARGV[2] then
      -- the same claim retried after a lost reply: hand back the same lease
      return {1, tonumber(f), tonumber(a), tonumber(e), epoch, false, false}
    end
    return {0, label, tonumber(f), tonumber(e), now, epoch}
  end
  prev_label, prev_fence = label, tonumber(f)
end
local fence = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') + 1
if fence < now then fence = now end
local exp = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[3], ARGV[1], fmt(fence))
redis.call('HSET', KEYS[1], ARGV[1],
  ARGV[2] .. ' ' .. fmt(fence) .. ' ' .. fmt(now) .. ' ' .. fmt(exp) .. ' ' .. ARGV[3])
redis.call('ZADD', KEYS[2], exp, ARGV[1])
return {1, fence, now, exp, epoch, prev_label, prev_fence}
"""
)

RENEW = (
    """
-- KEYS[3i-2] leases hash, KEYS[3i-1] expiry zset and KEYS[3i] epoch key of lease i's shard
-- ARGV[4i-3] resource, ARGV[4i-2] owner token, ARGV[4i-1] fence, ARGV[4i] ttl (us) of lease i;
-- a ttl of 0 only verifies the lease and changes nothing
-- returns {now_us, r1, r2, ...} with ri = {1, expires_us} or {0, reason, holder_label, fence};
-- reason 'store_reset' when the shard's epoch is gone (the server lost its data)
"""
    + _PRELUDE
    + """
local out = {now}
for i = 1, #KEYS / 3 do
  local leases, expiry, epoch = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local res, tok, fence, ttl = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
  local cur = redis.call('HGET', leases, res)
  if not cur then
    if redis.call('EXISTS', epoch) == 0 then
      out[#out + 1] = {0, 'store_reset'}
    else
      out[#out + 1] = {0, 'released'}
    end
  else
    local ctok, cf, a, e, label = parse(cur)
    if ctok ~= tok or cf ~= fence then
      out[#out + 1] = {0, 'taken_over', label, tonumber(cf)}
    elseif tonumber(e) <= now then
      out[#out + 1] = {0, 'expired'}
    elseif tonumber(ttl) == 0 then
      out[#out + 1] = {1, tonumber(e)}
    else
      local exp = now + tonumber(ttl)
      local rec = ctok .. ' ' .. cf .. ' ' .. a .. ' ' .. fmt(exp) .. ' ' .. label
      redis.call('HSET', leases, res, rec)
      redis.call('ZADD', expiry, exp, res)
      out[#out + 1] = {1, exp}
    end
  end
end
return out
"""
)

RELEASE = """
-- KEYS[1] leases hash, KEYS[2] expiry zset
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] fence
-- returns 1 when released, 0 when the lease was not this owner's (nothing changed)
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local tok, f = string.match(cur, '^(%x+) (%d+) ')
if tok ~= ARGV[2] or f ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

GET = (
    """
-- KEYS[1] leases hash
-- ARGV[1] resource
-- returns {now_us, record|nil}
"""
    + _PRELUDE
    + """
return {now, redis.call('HGET', KEYS[1], ARGV[1])}
"""
)

FORCE_RELEASE = (
    """
-- KEYS[1] leases hash, KEYS[2] expiry zset, KEYS[3] fences hash
-- ARGV[1] resource
-- drops the lease whoever holds it and bumps the fence past every fence issued before
-- returns {now_us, evicted record|nil, new fence floor}
"""
    + _PRELUDE
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local fence = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') + 1
if fence < now then fence = now end
redis.call('HSET', KEYS[3], ARGV[1], fmt(fence))
return {now, cur, fence}
"""
)

LIST = (
    """
-- KEYS[2s-1] leases hash and KEYS[2s] expiry zset of shard s, for every shard
-- ARGV[1] '1' for expired leases only, ARGV[2] cursor expiry (us) or '', ARGV[3] cursor
-- resource, ARGV[4] resource prefix or '', ARGV[5] page size
-- returns {now_us, more (0/1), resource1, record1, resource2, record2, ...} by (expiry, name)
"""
    + _PRELUDE
    + """
-- byte order, as a sorted set orders equal scores (Lua's < follows the server's locale)
local function before(x, y)
  for k = 1, math.min(#x, #y) do
    local bx, by = string.byte(x, k), string.byte(y, k)
    if bx ~= by then return bx < by end
  end
  return #x < #y
end
local limit = tonumber(ARGV[5])
local max = '+inf'
if ARGV[1] == '1' then max = fmt(now) end
local min = '-inf'
local after_score = nil
if ARGV[2] ~= '' then
  min = ARGV[2]
  after_score = tonumber(ARGV[2])
end
local prefix = ARGV[4]
local items = {}
local more = 0
for s = 1, #KEYS / 2 do
  local expiry = KEYS[2 * s]
  local found, offset = 0, 0
  while found <= limit do
    local batch = redis.call('ZRANGEBYSCORE', expiry, min, max, 'WITHSCORES', 'LIMIT', offset, 256)
    if #batch == 0 then break end
    offset = offset + #batch / 2
    for j = 1, #batch, 2 do
      local name, score = batch[j], tonumber(batch[j + 1])
      local past = after_score == nil or score > after_score or
        (score == after_score and before(ARGV[3], name))
      if past and (prefix == '' or string.sub(name, 1, #prefix) == prefix) then
        found = found + 1
        if found > limit then
          more = 1
          break
        end
        items[#items + 1] = {score, name, s}
      end
    end
  end
end
table.sort(items, function(x, y)
  if x[1] ~= y[1] then return x[1] < y[1] end
  return before(x[2], y[2])
end)
if #items > limit then more = 1 end
local out = {now, more}
for k = 1, math.min(limit, #items) do
  local name, s = items[k][2], items[k][3]
  local rec = redis.call('HGET', KEYS[2 * s - 1], name)
  out[#out + 1] = name
  out[#out + 1] = rec or ''
end
return out
"""
)

GATE_ADMIT = """
-- KEYS[1] the fence gate key of one side-effect key
-- ARGV[1] the fence to admit
-- admits a fence >= the highest admitted so far and records it
-- returns {1, fence} when admitted, {0, highest} when the fence is stale
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) > tonumber(ARGV[1]) then
  return {0, tonumber(cur)}
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, tonumber(ARGV[1])}
"""
