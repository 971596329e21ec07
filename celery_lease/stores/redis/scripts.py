r"""Lua scripts of the Redis lease store.

Key layout (every key is fixed per shard, resource names are only hash fields and set members,
so no user input ever becomes part of a lease key name or pattern):

```text
<prefix>{NN}:leases    hash   resource -> "<token> <fence> <acquired_us> <expires_us> <label>"
                              followed, when the claim recovered earlier work, by
                              "\n<prev_fence>\n<identity_state>\n<identity_fence>\n
                              <identity_label>\n<prev_label>" (the recovery facts, so a claim
                              retried after a lost reply returns them too; older scripts wrote
                              them without the identity record's fence and label)
<prefix>{NN}:expiry    zset   resource -> expires_us (the expiry index)
<prefix>{NN}:fences    hash   resource -> last fence issued (no TTL, never reset),
                              "!epoch" -> server time (us) when the shard was first written,
                              and "!forced:<resource>" -> "<evicted fence> <fence after>" of
                              the last force-release there (until the fence moves on, its owner
                              learns why it lost the lease)
<prefix>{NN}:ids       hash   "<resource>|<identity>" ->
                              "<state>\n<fence>\n<token>\n<label>\n<result>"
<prefix>{NN}:ids_exp   zset   "<resource>|<identity>" -> when the record expires (us)
<prefix>{NN}:ckpt      hash   "<resource>|<identity>" -> "<fence>\n<checkpoints json>"
<prefix>{NN}:ledger    hash   "<resource>|<identity>|<key>" ->
                              "<state>\n<fence>\n<token>\n<receipt>"
<prefix>{NN}:ledger_exp zset  "<resource>|<identity>|<key>" -> when the entry expires (us)
<prefix>{NN}:waits     hash   resource -> the FIFO wait list, one line per waiter, oldest
                              first: "<identity> <since_us> <expires_us> <woken_until_us>"
                              and " <attempt>" when a retried attempt (> 0) was listed, or
                              " <attempt> 1" (attempt 0 too) once its missed wake was sent
                              again (wake_due; a wake or a re-arm drops the mark);
                              "!<resource>" -> until when nothing is held for a woken head
                              (a wake missed its grace lately); "!!<resource>" -> the grace
                              end of the latest wake, dropped once that waiter leaves the list
                              or is re-armed (a release reads every line only while it lies
                              ahead: a wake may be in flight)
<prefix>{NN}:wpay      hash   "<resource>|<identity>" -> the waiter's wake payload (the
                              message its task sends again when woken), opaque text
<prefix>{NN}:waits_exp zset   resource -> when its last waiter's place lapses (us; never
                              earlier, it may be later: a woken head's claim leaves it as it
                              was): the sweep drops wait lists nobody touched again through it
<prefix>{NN}:gates     hash   side-effect key -> the highest fence a FenceGate admitted for
                              it (no TTL, never reset); the key is validated by the resource-
                              name rule (no braces, globs or spaces) and lives in the shard of
                              the resource of the same name, so that the gate script reads that
                              resource's fence in the fences hash in the same slot
```

``<prefix>gate:<key>`` strings are the gates of the earlier layout (versions before the gates
hash: one string per side-effect key, in a slot of its own). Nothing writes them any more; a
gate still counts their fences, so an upgrade never admits a fence older than one admitted
before it: on a single server the gate script reads the key's string too; on a cluster (another
slot) the store reads it before the key's first admit into the gates hash and passes its value
in (from then on the hash holds at least that fence).

``NN`` is the resource's shard (crc32 of the name modulo the shard count). ``{NN}`` is the hash
tag, so a resource's keys share one Redis Cluster slot. Times are microseconds of the server's
``TIME``. A fence is ``max(last fence + 1, server time in us)``: strictly increasing, and still
greater than anything issued before if the server lost its data (restart without persistence),
as long as the server clock does not step back.
"""

from __future__ import annotations

from .._bounds import POLL, POLL_HOLD, POLL_PLACES, REARM_GROWTH, WAKE_DUE_SKIP

# Lua building blocks; each script includes only what it uses (every line costs server time).
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function fmt(n) return string.format('%.0f', n) end
"""
_PARSE = """
-- token, fence, acquired, expires, label, tail ('' or the recovery facts, see the key layout)
local function parse(rec)
  return string.match(rec, '^(%x+) (%d+) (%d+) (%d+) ([^\\n]*)(.*)$')
end
local function parse_label(rec)
  local _, _, _, _, label = parse(rec)
  return label
end
"""
_GONE = """
-- why the lease of this resource and fence has no record: the shard lost its data, an
-- administrator force-released it (and nobody claimed the resource since), or it was released
local function gone(fences, res, fence)
  local marks = redis.call('HMGET', fences, '!epoch', '!forced:' .. res, res)
  if not marks[1] then return 'store_reset' end
  if marks[2] and marks[2] == fence .. ' ' .. tostring(marks[3]) then
    return 'force_released'
  end
  return 'released'
end
"""
_IDENT = """
-- state, fence, owner token, label, result
local function parse_ident(rec)
  return string.match(rec, '^([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n(.*)$')
end
-- drop up to two expired entries of a retention index and their records (bounded work)
local function trim(index, now, hash1, hash2)
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, 2)
  for _, m in ipairs(old) do
    redis.call('HDEL', hash1, m)
    if hash2 then redis.call('HDEL', hash2, m) end
    redis.call('ZREM', index, m)
  end
end
"""
_PRELUDE = _NOW + _PARSE + _IDENT
_WAITS = (
    f"""
local POLL, POLL_HOLD, POLL_PLACES = '{POLL}', {POLL_HOLD}, {POLL_PLACES}
"""
    + """
-- the resource's wait list, expired waiters (and their payloads) dropped; returns list, dirty.
-- list.slow: until when (us) nothing is held for a woken head, because a wake missed its grace
-- lately (a woken waiter did not claim in time: its message waits behind a backlog, or its
-- worker is paused); each miss keeps it `hold` us. Kept in the waits hash as "!<resource>"
-- (no resource name contains '!'). `got`: the two fields, when the caller read them already.
local function wl_load(wkey, pkey, res, now, hold, got)
  got = got or redis.call('HMGET', wkey, res, '!' .. res)
  local list, dirty = {slow = tonumber(got[2] or '0')}, false
  if not got[1] then return list, dirty end
  for id, s, e, w, a, r in string.gmatch(
      got[1], '([^ \\n]+) (%d+) (%d+) (%d+) ?(%d*) ?(%d*)') do
    local woken = tonumber(w)
    if woken ~= 0 and woken <= now and woken + hold > list.slow then
      list.slow = woken + hold  -- woken, and did not claim within its grace
      dirty = true
    end
    if tonumber(e) > now then
      list[#list + 1] = {id, s, e, w, a, r}
    else
      dirty = true
      redis.call('HDEL', pkey, res .. '|' .. id)
    end
  end
  if #list == 0 then list.slow = 0 end  -- the pause after a missed wake ends with the list
  return list, dirty
end
local function wl_save(wkey, xkey, res, list)
  if #list == 0 then
    redis.call('HDEL', wkey, res, '!' .. res, '!!' .. res)
    redis.call('ZREM', xkey, res)
    return
  end
  local parts, last = {}, 0
  for k, e in ipairs(list) do
    parts[k] = e[1] .. ' ' .. e[2] .. ' ' .. e[3] .. ' ' .. e[4]
    if e[6] == '1' then
      parts[k] = parts[k] .. ' ' .. (e[5] ~= '' and e[5] or '0') .. ' 1'
    elseif e[5] ~= '' and e[5] ~= '0' then
      parts[k] = parts[k] .. ' ' .. e[5]
    end
    if tonumber(e[3]) > last then last = tonumber(e[3]) end
  end
  redis.call('HSET', wkey, res, table.concat(parts, '\\n'))
  if list.slow > 0 then
    redis.call('HSET', wkey, '!' .. res, fmt(list.slow))
  else
    redis.call('HDEL', wkey, '!' .. res)
  end
  redis.call('ZADD', xkey, last, res)
end
-- mark this waiter woken until `until_` (its place is kept at least as long); the free resource
-- is held for it until then (against the claims listed behind it). Once that passes unclaimed,
-- the waiter keeps its place and is not woken again until a refused claim of its own re-arms
-- it (join()).
-- how long a woken waiter with this payload is held for: POLL_HOLD graces for a polling one
local function held_for(payload, grace)
  if payload == POLL then return POLL_HOLD * tonumber(grace) end
  return tonumber(grace)
end
-- a wake payload's bytes as the bounds count them: none for a polling place's
local function msg_len(payload)
  if payload == POLL or not payload then return 0 end
  return #payload
end
local function wl_wake(w, until_)
  w[4] = fmt(until_)
  if until_ > tonumber(w[3]) then w[3] = w[4] end
  w[6] = ''
end
"""
)


def _release_tail(
    leases: int, expiry: int, waits: int, wpay: int, grace: int, lazy: bool = False
) -> str:
    # KEYS[waits + 2] is the waits_exp index. lazy: the script has not read TIME nor defined
    # the wait-list functions yet; done only when somebody waits (most releases: nobody).
    """Release the lease in KEYS[leases] if ARGV[2] (token) and ARGV[3] (fence) hold it, then
    wake the first waiter never woken, unless a wake was sent less than the grace ago; its
    wake payload is returned for the releaser to send. A woken head may claim alone until
    now + grace. A head woken before that did not claim within its grace (its copy waits
    behind a backlog, or its worker is paused) keeps its place, but nothing is held for it:
    the next claim takes the resource, which does not sit idle."""
    return f"""
local cur = redis.call('HGET', KEYS[{leases}], ARGV[1])
if not cur then return 0 end
local tok, f = string.match(cur, '^(%x+) (%d+) ')
if tok ~= ARGV[2] or f ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[{leases}], ARGV[1])
redis.call('ZREM', KEYS[{expiry}], ARGV[1])
local waiting = redis.call('HMGET', KEYS[{waits}], ARGV[1], '!' .. ARGV[1], '!!' .. ARGV[1])
if not waiting[1] then return 1 end  -- nobody waits: nothing to hand over
{_NOW + _WAITS if lazy else ""}
-- a missed wake stops holding the resource for woken heads for 10 graces
local hold = 10 * tonumber(ARGV[{grace}])
if tonumber(waiting[3] or '0') <= now then
  -- No wake in flight (the latest wake's grace is over, or its waiter left or was re-armed):
  -- wake the first line never woken, read up to it, and edit that line in the text instead of
  -- reading and rewriting every line; the full path below would change no other line (the
  -- expired lines are dropped, and the missed wakes behind it counted, by the next full load).
  local slow = tonumber(waiting[2] or '0')
  local function keep_slow()  -- the missed wakes read on the way, when they hold longer
    if slow > tonumber(waiting[2] or '0') then
      redis.call('HSET', KEYS[{waits}], '!' .. ARGV[1], fmt(slow))
    end
  end
  for at, id, since, e, w, after in string.gmatch(
      waiting[1], '()([^ \\n]+) (%d+) (%d+) (%d+)()') do
    local woken = tonumber(w)
    if tonumber(e) > now and woken == 0 then
      local payload = redis.call('HGET', KEYS[{wpay}], ARGV[1] .. '|' .. id)
      local until_ = now + held_for(payload, ARGV[{grace}])
      local last = tonumber(e)
      if until_ > last then last = until_ end
      redis.call('HSET', KEYS[{waits}], ARGV[1],
        string.sub(waiting[1], 1, at - 1) .. id .. ' ' .. since .. ' ' .. fmt(last) .. ' ' ..
        fmt(until_) .. string.sub(waiting[1], after), '!!' .. ARGV[1], fmt(until_))
      local kept = redis.call('ZSCORE', KEYS[{waits + 2}], ARGV[1])
      if not kept or tonumber(kept) < last then
        redis.call('ZADD', KEYS[{waits + 2}], last, ARGV[1])
      end
      keep_slow()
      return {{1, payload, id}}
    end
    if woken ~= 0 and woken + hold > slow then slow = woken + hold end  -- (woken <= now)
  end
  keep_slow()
  return 1
end
local wl, dirty = wl_load(KEYS[{waits}], KEYS[{wpay}], ARGV[1], now, hold, waiting)
local woke = nil
for _, w in ipairs(wl) do
  local t = tonumber(w[4])
  if t > now then  -- a wake sent less than the grace ago: not another one (a backlog?)
    woke = nil
    break
  end
  if t == 0 and not woke then woke = w end
end
if not woke then
  if dirty then wl_save(KEYS[{waits}], KEYS[{waits + 2}], ARGV[1], wl) end
  return 1
end
local payload = redis.call('HGET', KEYS[{wpay}], ARGV[1] .. '|' .. woke[1])
wl_wake(woke, now + held_for(payload, ARGV[{grace}]))
wl_save(KEYS[{waits}], KEYS[{waits + 2}], ARGV[1], wl)
redis.call('HSET', KEYS[{waits}], '!!' .. ARGV[1], woke[4])
return {{1, payload, woke[1]}}
"""


ACQUIRE = (
    """
-- KEYS[1] leases hash, KEYS[2] expiry zset, KEYS[3] fences hash (with the shard "!epoch"),
-- KEYS[4] ids hash, KEYS[5] ids_exp zset, KEYS[6] ckpt hash, KEYS[7] waits hash,
-- KEYS[8] wpay hash, KEYS[9] waits_exp zset
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] owner label, ARGV[4] ttl (us),
-- ARGV[5] identity or '', ARGV[6] retention (us), ARGV[7] wake payload or '' (join the wait
-- list when refused; needs an identity), ARGV[8] how long the waiter's place is kept (us),
-- ARGV[9] wait list cap, ARGV[10] hand-off grace (us), ARGV[11] the most bytes of wake
-- payloads the list holds (a new waiter that would pass it, or the cap, is not listed),
-- ARGV[12] the claim's attempt or '' (a copy of an older attempt than the one listed for its
-- identity neither re-arms, replaces the payload of, nor claims as that waiter),
-- ARGV[13] '1' to get back, with the lease, the wake payload of the waiter a release would
-- wake now (the first never woken, none while a wake is in flight), or ''
-- ARGV[14] '1' to also get back the wake payload this claimant's own place held when the
-- claim took it off the list (its waits count may be newer than this copy's), or ''
-- ARGV[15] the name of the claimant's place when it has no identity ('': its identity)
-- ARGV[16] when its message was published (us), to be placed by it, or '' (placed by now)
-- ARGV[17] how far (us) ARGV[16] may lie ahead of now: a later one counts as that far ahead
-- While the resource has no live lease, it is held for its first waiter that did not miss its
-- grace (never woken, or woken less than the grace ago): only that waiter, or one listed before
-- it (woken, past its grace: an earlier arrival), may claim it (invariant 13).
-- returns {1, fence, acquired_us, expires_us, epoch, prev_label|nil, prev_fence|nil,
--          identity_state|nil, identity_fence|nil, identity_label|nil, checkpoints|nil,
--          next wake payload|nil, own wake payload|nil}
--      or {0, holder_label, holder_fence, holder_expires_us, now_us, epoch, duplicate,
--          position, wake payload|false, polling (1: its place is a polling one, else 0)}
--         (duplicate 1 when the holder runs this same identity, else 0; position in the wait
--         list, 0 when not queued; the payload of a head waiter to wake, when the resource is
--         free but reserved for a head nobody woke within the grace window)
--      or {2, fence, result, owner label} when the identity is already done (nothing
--         claimed)
"""
    + _NOW
    + _PARSE
    + _WAITS
    + """
local member, ident, ist, ifence, ilabel = false, false, false, false, false
-- the claimant's place: named by its identity, or by its waiter name
local pname = ARGV[15] ~= '' and ARGV[15] or (ARGV[5] ~= '' and ARGV[5] or false)
local pmember = pname and (ARGV[1] .. '|' .. pname)
if ARGV[5] ~= '' then
"""
    + _IDENT
    + """
  member = ARGV[1] .. '|' .. ARGV[5]
  trim(KEYS[5], now, KEYS[4], KEYS[6])
  ident = redis.call('HGET', KEYS[4], member)
  local kept = redis.call('ZSCORE', KEYS[5], member)
  if ident and (not kept or tonumber(kept) <= now) then ident = false end  -- past retention
  if ident then
    local result
    local itoken
    ist, ifence, itoken, ilabel, result = parse_ident(ident)
    if ist == 'done' then return {2, tonumber(ifence), result, ilabel} end
  end
end
local got = redis.call('HMGET', KEYS[3], ARGV[1], '!epoch')
local epoch = got[2]
if not epoch then
  epoch = fmt(now)
  redis.call('HSET', KEYS[3], '!epoch', epoch)
end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local prev_label, prev_fence = false, false
local fence = nil
local acquired, exp = now, now + tonumber(ARGV[4])
local ckpt = false
local wgot = redis.call('HMGET', KEYS[7], ARGV[1], '!' .. ARGV[1], '!!' .. ARGV[1])
-- "!!<resource>": when the grace of the latest wake ends (us). At most one wake is in flight;
-- once this passed, or that waiter left the list or was re-armed (then it is dropped), no line
-- is woken less than the grace ago and a release need not read every line to know it.
local function in_flight_gone() redis.call('HDEL', KEYS[7], '!!' .. ARGV[1]) end
-- The hand-off's usual claim: the resource is free (or its lease ran out) and this claimant is
-- the list's first waiter (not expired, not a copy of an older attempt). Whatever the list
-- holds behind it, the full path below would take the resource, drop this waiter's line and
-- change no other line (expired lines are dropped whenever a full load meets them, and a
-- missed wake behind the head counts then too). So the first line is cut off the text
-- instead of reading and rewriting every line (most of a woken claim's cost on a long list);
-- `rest`: the lines behind it, or nil (the full path).
local rest = nil
local ownp = false
local hold = 10 * tonumber(ARGV[10])  -- a missed wake stops holding woken heads this long
if pname and wgot[1] and string.sub(wgot[1], 1, #pname + 1) == pname .. ' ' then
  local free = true
  if cur then  -- (a lease run out is free, its own claim sent again too)
    local _, _, _, e = parse(cur)
    free = tonumber(e) <= now
  end
  local e, w, a, tail = string.match(
    wgot[1], '^[^ \\n]+ %d+ (%d+) (%d+) ?(%d*) ?%d*\\n?(.*)$')
  -- Also the full path's outcome only while the list goes on after this line as it was: some
  -- line behind it still live (else the full path ends the list, and its hold after a missed
  -- wake with it) and the list's latest lapse not this line's (else the full path moves the
  -- lapse index earlier, and a sweep may end the list sooner).
  local function goes_on()
    if tail == '' then return true end
    local last = redis.call('ZSCORE', KEYS[9], ARGV[1])
    if not last or tonumber(e) >= tonumber(last) then return false end
    for lapse in string.gmatch(tail, '[^ \\n]+ %d+ (%d+) %d+') do
      if tonumber(lapse) > now then return true end
    end
    return false
  end
  if free and e and tonumber(e) > now and
      not (ARGV[12] ~= '' and a ~= '' and tonumber(ARGV[12]) < tonumber(a)) and goes_on() then
    rest = tail
    local woken = tonumber(w)
    if rest == '' then
      wl_save(KEYS[7], KEYS[9], ARGV[1], {slow = 0})  -- (the list ends)
    else
      -- (the lapse index keeps the old latest lapse: never earlier than the list's own)
      redis.call('HSET', KEYS[7], ARGV[1], rest)
      if woken ~= 0 and woken <= now and woken + hold > tonumber(wgot[2] or '0') then
        redis.call('HSET', KEYS[7], '!' .. ARGV[1], fmt(woken + hold))
      end
      if woken > now then in_flight_gone() end
    end
    if ARGV[14] == '1' then ownp = redis.call('HGET', KEYS[8], pmember) end
    redis.call('HDEL', KEYS[8], pmember)
  end
end
local wl, dirty = {slow = 0}, false
if not rest then wl, dirty = wl_load(KEYS[7], KEYS[8], ARGV[1], now, hold, wgot) end
-- a copy of an older attempt than the one `w` was listed by (a place or a claim without an
-- attempt, or at attempt 0, is never older)
local function older(w)
  return ARGV[12] ~= '' and w[5] ~= '' and tonumber(ARGV[12]) < tonumber(w[5])
end
local polling = 0  -- 1: the claimant's place is a polling one (nobody sends its message)
local function join()  -- this claimant's place in the wait list (0: not queued)
  if ARGV[7] == '' or not pname then return 0 end
  local until_ = fmt(now + tonumber(ARGV[8]))
  for k, w in ipairs(wl) do
    if w[1] == pname and older(w) then  -- the newer attempt keeps its wake
      if redis.call('HGET', KEYS[8], pmember) == POLL then polling = 1 end
      return k
    end
    if w[1] == pname then  -- already waiting: keep the place, refresh it, and re-arm it
      -- (refused again: a woken copy too late or beaten to it, or a back-stop copy), so the
      -- next release wakes it again
      if tonumber(until_) > tonumber(w[3]) then w[3] = until_ end
      if tonumber(w[4]) > now then in_flight_gone() end
      w[4] = '0'
      w[6] = ''  -- (re-armed: a later missed wake may be sent again)
      -- its new payload replaces the old one within the bytes bound (base.rearm_fits: the
      -- cap, plus REARM_GROWTH per waiter for a payload that grew that much at most; else the
      -- old, valid one is kept)
      local had = redis.call('HSTRLEN', KEYS[8], pmember)
      if had == #POLL then had = msg_len(redis.call('HGET', KEYS[8], pmember)) end
      local grew = msg_len(ARGV[7]) - had
      local fits = grew <= 0
      if not fits then
        local bytes, cap = grew, tonumber(ARGV[11])
        for _, v in ipairs(wl) do
          local n = redis.call('HSTRLEN', KEYS[8], ARGV[1] .. '|' .. v[1])
          if n == #POLL then n = msg_len(redis.call('HGET', KEYS[8], ARGV[1] .. '|' .. v[1])) end
          bytes = bytes + n
        end
        if grew <= """
    + str(REARM_GROWTH)
    + """ then cap = cap + """
    + str(REARM_GROWTH)
    + """ * #wl end
        fits = bytes <= cap
      end
      if fits then
        redis.call('HSET', KEYS[8], pmember, ARGV[7])
        w[5] = ARGV[12]
      end
      if redis.call('HGET', KEYS[8], pmember) == POLL then polling = 1 end
      dirty = true
      return k
    end
  end
  -- a new place: with its message while the list has room for it, else a polling place
  local cap = tonumber(ARGV[9])
  if #wl >= POLL_PLACES * cap then return 0 end
  local payload = ARGV[7]
  if payload ~= POLL then
    local bytes, messages = #payload, #wl
    for _, w in ipairs(wl) do
      local n = redis.call('HSTRLEN', KEYS[8], ARGV[1] .. '|' .. w[1])
      if n == #POLL and redis.call('HGET', KEYS[8], ARGV[1] .. '|' .. w[1]) == POLL then
        messages, n = messages - 1, 0
      end
      bytes = bytes + n
    end
    if messages >= cap or bytes > tonumber(ARGV[11]) then payload = POLL end
  end
  if payload == POLL then polling = 1 end
  -- behind every place not listed later than it (its publish time, at most ARGV[17] ahead of
  -- now: a publisher's clock a little fast keeps its order; else now)
  local at = now
  if ARGV[16] ~= '' then
    at = math.min(tonumber(ARGV[16]), now + tonumber(ARGV[17]))
  end
  local pos = #wl + 1
  while pos > 1 and tonumber(wl[pos - 1][2]) > at do pos = pos - 1 end
  table.insert(wl, pos, {pname, fmt(at), until_, '0', ARGV[12], ''})
  redis.call('HSET', KEYS[8], pmember, payload)
  dirty = true
  return pos
end
local live, mine = false, false
if cur then
  local tok, f, a, e = parse(cur)
  live = tonumber(e) > now and tok ~= ARGV[2]
  mine = tonumber(e) > now and tok == ARGV[2]
  if live then
    local dup = 0
    if ist == 'running' and ifence == f then dup = 1 end
    local pos = 0
    if dup == 0 then pos = join() end
    if dirty then wl_save(KEYS[7], KEYS[9], ARGV[1], wl) end
    return {0, parse_label(cur), tonumber(f), tonumber(e), now, epoch, dup, pos, false, polling}
  end
end
-- (a claim sent again while its lease is live gets that lease back, below; once the lease ran
-- out, it is a new claim)
if #wl > 0 and not mine then
  -- the waiter held for: the one whose wake is in flight (woken less than the grace ago: one
  -- wake at a time, even with a re-armed waiter ahead of it), else the first never woken,
  -- unless this claimant is that waiter or listed before it
  local held = false
  if wl.slow <= now then
    local pick = false
    for _, w in ipairs(wl) do
      local woken = tonumber(w[4])
      if woken > now then
        pick = w
        break
      end
      if woken == 0 and not pick then pick = w end
    end
    for _, w in ipairs(wl) do
      if w[1] == pname and not older(w) then break end
      if w == pick then
        held = w
        break
      end
    end
  end
  if held then
    -- held for a waiter ahead of this claim: wait behind it
    local pos = join()
    local wake = false
    if tonumber(held[4]) == 0 then  -- nobody woke it (the releaser died?): wake it now
      wake = redis.call('HGET', KEYS[8], ARGV[1] .. '|' .. held[1])
      wl_wake(held, now + held_for(wake, ARGV[10]))
      redis.call('HSET', KEYS[7], '!!' .. ARGV[1], held[4])
      dirty = true
    end
    if dirty then wl_save(KEYS[7], KEYS[9], ARGV[1], wl) end
    return {0, 'the waiting task ' .. held[1] .. ' (hand-off)', tonumber(got[1] or '0'),
      tonumber(held[4]), now, epoch, 0, pos, wake, polling}
  end
  -- the waiter held for claims, or a waiter ahead of it that missed its grace (an earlier
  -- arrival); or a wake missed its grace lately (woken copies wait behind a backlog, or their
  -- workers are paused) and nothing is held: this claim takes the resource rather than
  -- leaving it idle. A waiter that claims leaves the list (a copy of an older attempt leaves
  -- the newer attempt's place listed).
  for k, w in ipairs(wl) do
    if w[1] == pname and not older(w) then
      if tonumber(w[4]) > now then in_flight_gone() end
      table.remove(wl, k)
      if ARGV[14] == '1' then ownp = redis.call('HGET', KEYS[8], pmember) end
      redis.call('HDEL', KEYS[8], pmember)
      dirty = true
      break
    end
  end
end
if dirty then wl_save(KEYS[7], KEYS[9], ARGV[1], wl) end
if cur then
  local tok, f, a, e, label, tail = parse(cur)
  if tonumber(e) > now then
    -- the same claim retried after a lost reply: hand back the same lease with the recovery
    -- facts the first attempt found (its identity record is ours now; the facts are the tail)
    fence, acquired, exp = tonumber(f), tonumber(a), tonumber(e)
    ist, ifence, ilabel = false, false, false
    local pf, st, idf, idl, pl = string.match(
      tail, '^\\n([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n(.*)$')
    if not pf then
      pf, st, pl = string.match(tail, '^\\n([^\\n]*)\\n([^\\n]*)\\n(.*)$')
    end
    if pf and pf ~= '' then prev_label, prev_fence = pl, tonumber(pf) end
    if st and st ~= '' then
      ist = st
      if idf and idf ~= '' then ifence = idf end
      if idl and idl ~= '' then ilabel = idl end
      if member then ckpt = redis.call('HGET', KEYS[6], member) end
    end
  else
    prev_label, prev_fence = label, tonumber(f)
  end
end
if not fence then
  fence = tonumber(got[1] or '0') + 1
  if fence < now then fence = now end
  local fs = fmt(fence)
  if ident and tonumber(ifence) ~= fence then
    ckpt = redis.call('HGET', KEYS[6], member)  -- an earlier attempt of this identity
  else
    ist, ifence, ilabel = false, false, false
  end
  local rec = ARGV[2] .. ' ' .. fs .. ' ' .. fmt(now) .. ' ' .. fmt(exp) .. ' ' .. ARGV[3]
  if prev_fence or ist then  -- keep what a retried claim must report (see the key layout)
    local pf, pl = prev_fence, prev_label
    if not pf then pf, pl = ifence, ilabel end
    rec = rec .. '\\n' .. (pf and fmt(tonumber(pf)) or '') .. '\\n' .. (ist or '') .. '\\n' ..
      (ist and ifence and fmt(tonumber(ifence)) or '') .. '\\n' .. (ist and ilabel or '') ..
      '\\n' .. (pl or '')
  end
  redis.call('HSET', KEYS[3], ARGV[1], fs)
  redis.call('HSET', KEYS[1], ARGV[1], rec)
  redis.call('ZADD', KEYS[2], exp, ARGV[1])
end
if member then
  local rec = 'running\\n' .. fmt(fence) .. '\\n' .. ARGV[2] .. '\\n' .. ARGV[3] .. '\\n'
  redis.call('HSET', KEYS[4], member, rec)
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[6]), member)
end
local nextp = false
if ARGV[13] == '1' then
  -- What the release would do now (see the release): the first line never woken, unless a
  -- wake is in flight. That wake's line may come after the first never woken (a head that
  -- missed its grace came back); so when "!!" says one may be in flight, read on.
  local first = false
  local function next_wake(id, e, t)  -- true once decided
    if tonumber(e) <= now then return false end  -- (an expired line is not listed)
    if tonumber(t) > now then  -- a wake in flight: a release now wakes nobody
      first = false
      return true
    end
    if tonumber(t) == 0 and not first then
      first = id
      return tonumber(redis.call('HGET', KEYS[7], '!!' .. ARGV[1]) or '0') <= now
    end
    return false
  end
  if rest then
    for id, e, t in string.gmatch(rest, '([^ \\n]+) %d+ (%d+) (%d+)') do
      if next_wake(id, e, t) then break end
    end
  else
    for _, w in ipairs(wl) do
      if next_wake(w[1], w[3], w[4]) then break end
    end
  end
  if first then nextp = redis.call('HGET', KEYS[8], ARGV[1] .. '|' .. first) end
end
return {1, fence, acquired, exp, epoch, prev_label, prev_fence, ist, ifence, ilabel, ckpt, nextp,
  ownp}
"""
)

# The preludes below put a script's arguments back in its own order (the ARGV its header names)
# from the order the store sends them in: first those that are the same call after call (the
# store's settings, the task's ttl), which the store packs once with the keys (Connections.
# evalsha's ``fixed``), then those of this call. Put before the script, or a test's patched
# copy of it.

#: Put before ACQUIRE, the claim most tasks send: no identity, no place to wait in, no
#: attempt, no waiter name, placed by arrival. Six arguments to pack and parse instead of
#: seventeen; the claim below reads the same values it would be sent (the ones it does not
#: read on this path, retention and the wait list's bounds, are only read with an identity or
#: a place to join).
#: ARGV[1] ttl (us), ARGV[2] hand-off grace (us), ARGV[3] '1' to get back the next wake
#: payload (ACQUIRE's ARGV[13]) or '', then ARGV[4] resource, ARGV[5] owner token,
#: ARGV[6] owner label
#: returns what ACQUIRE returns
SHORT_CLAIM = """
local ARGV = {ARGV[4], ARGV[5], ARGV[6], ARGV[1], '', '0', '', '0', '0', ARGV[2], '0', '',
  ARGV[3], '', '', '', '0'}
"""

#: Put before ACQUIRE, every other claim: its seventeen arguments, the fixed ones first.
#: ARGV[1] ttl (us), ARGV[2] retention (us), ARGV[3] wait list cap, ARGV[4] hand-off grace
#: (us), ARGV[5] the most bytes of wake payloads, ARGV[6] '1' for the next wake payload or '',
#: ARGV[7] '1' for the claimant's own place's payload or '', ARGV[8] how far (us) a since may
#: lie ahead, then ARGV[9] resource, ARGV[10] owner token, ARGV[11] owner label, ARGV[12]
#: identity or '', ARGV[13] wake payload or '', ARGV[14] how long the place is kept (us),
#: ARGV[15] attempt or '', ARGV[16] the place's name or '', ARGV[17] since (us) or ''
#: (ACQUIRE's ARGV 4, 6, 9, 10, 11, 13, 14, 17, then 1, 2, 3, 5, 7, 8, 12, 15, 16)
#: returns what ACQUIRE returns
HEADED_CLAIM = """
local ARGV = {ARGV[9], ARGV[10], ARGV[11], ARGV[1], ARGV[12], ARGV[2], ARGV[13], ARGV[14],
  ARGV[3], ARGV[4], ARGV[5], ARGV[15], ARGV[6], ARGV[7], ARGV[16], ARGV[17], ARGV[8]}
"""

#: Put before RELEASE: ARGV[1] hand-off grace (us), then ARGV[2] resource, ARGV[3] owner
#: token, ARGV[4] fence (RELEASE's ARGV 4, then 1, 2, 3); returns what RELEASE returns
HEADED_RELEASE = """
local ARGV = {ARGV[2], ARGV[3], ARGV[4], ARGV[1]}
"""

#: Put before RELEASE_OUTCOME: ARGV[1] retention (us), ARGV[2] hand-off grace (us), then
#: ARGV[3] resource, ARGV[4] owner token, ARGV[5] fence, ARGV[6] identity, ARGV[7] outcome,
#: ARGV[8] result or '' (RELEASE_OUTCOME's ARGV 7, 8, then 1 to 6); returns what it returns
HEADED_RELEASE_OUTCOME = """
local ARGV = {ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[1], ARGV[2]}
"""

RENEW = (
    """
-- KEYS[3i-2] leases hash, KEYS[3i-1] expiry zset and KEYS[3i] fences hash of lease i's shard
-- ARGV[4i-3] resource, ARGV[4i-2] owner token, ARGV[4i-1] fence, ARGV[4i] ttl (us) of lease i;
-- a ttl of 0 only verifies the lease and changes nothing
-- returns {now_us, r1, r2, ...} with ri = {1, expires_us} or {0, reason, holder_label, fence,
--         1 when that holder's lease expired too (taken_over) else 0};
-- reason 'store_reset' when the shard's epoch is gone (the server lost its data),
-- 'force_released' when an administrator evicted this lease
"""
    + _NOW
    + _PARSE
    + _GONE
    + """
local out = {now}
for i = 1, #KEYS / 3 do
  local leases, expiry, fences = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local res, tok, fence, ttl = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
  local cur = redis.call('HGET', leases, res)
  if not cur then
    out[#out + 1] = {0, gone(fences, res, fence)}
  else
    local ctok, cf, a, e, label, tail = parse(cur)
    if ctok ~= tok or cf ~= fence then
      out[#out + 1] = {0, 'taken_over', label, tonumber(cf), tonumber(e) <= now and 1 or 0}
    elseif tonumber(e) <= now then
      out[#out + 1] = {0, 'expired'}
    elseif tonumber(ttl) == 0 then
      out[#out + 1] = {1, tonumber(e)}
    else
      local exp = now + tonumber(ttl)
      local rec = ctok .. ' ' .. cf .. ' ' .. a .. ' ' .. fmt(exp) .. ' ' .. label .. tail
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
-- KEYS[1] leases hash, KEYS[2] expiry zset, KEYS[3] waits hash, KEYS[4] wpay hash,
-- KEYS[5] waits_exp zset
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] fence, ARGV[4] hand-off grace (us)
-- returns 1 when released, 0 when the lease was not this owner's (nothing changed),
-- {1, wake payload, identity} when released and handed over to the head waiter
""" + _release_tail(1, 2, 3, 4, 4, lazy=True)

RELEASE_OUTCOME = (
    """
-- KEYS[1] leases hash, KEYS[2] expiry zset, KEYS[3] ids hash, KEYS[4] ids_exp zset,
-- KEYS[5] waits hash, KEYS[6] wpay hash, KEYS[7] waits_exp zset
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] fence, ARGV[4] identity,
-- ARGV[5] outcome ('done', 'failed', 'retry'), ARGV[6] result (JSON) or '',
-- ARGV[7] retention (us), ARGV[8] hand-off grace (us)
-- records the identity's outcome if it still carries this fence, then releases the lease
-- returns 1 when released, 0 when the lease was not this owner's (the lease is unchanged),
-- {1, wake payload, identity} when released and handed over to the head waiter
"""
    + _NOW
    + _IDENT
    + _WAITS
    + """
local member = ARGV[1] .. '|' .. ARGV[4]
local ident = redis.call('HGET', KEYS[3], member)
if ident then
  local st, f, tok, label = parse_ident(ident)
  if f == ARGV[3] and tok == ARGV[2] and st ~= 'done' then
    local result = ''
    if ARGV[5] == 'done' then result = ARGV[6] end
    local rec = ARGV[5] .. '\\n' .. f .. '\\n' .. tok .. '\\n' .. label .. '\\n' .. result
    redis.call('HSET', KEYS[3], member, rec)
    redis.call('ZADD', KEYS[4], now + tonumber(ARGV[7]), member)
  end
end
"""
    + _release_tail(1, 2, 5, 6, 8)
)

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
-- ARGV[1] resource, ARGV[2] the fence of the lease to evict, or '' (whoever holds it)
-- drops the lease and bumps the fence past every fence issued before
-- returns {now_us, evicted record|nil, new fence floor}, or {now_us, false, false, record|nil}
-- when ARGV[2] names a fence the resource's lease does not have (nothing changed)
"""
    + _PRELUDE
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then
  local f = cur and select(2, parse(cur)) or nil
  if f ~= ARGV[2] then return {now, false, false, cur} end
end
local fence = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') + 1
if fence < now then fence = now end
redis.call('HSET', KEYS[3], ARGV[1], fmt(fence))
if cur then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  local _, evicted = parse(cur)
  -- marks the eviction until a claim or force-release moves the fence on (see gone())
  redis.call('HSET', KEYS[3], '!forced:' .. ARGV[1], evicted .. ' ' .. fmt(fence))
end
return {now, cur, fence}
"""
)

WAKE_DUE = (
    """
-- KEYS[4s-3] leases hash, KEYS[4s-2] waits hash, KEYS[4s-1] wpay hash and KEYS[4s] waits_exp
-- zset of shard s, for every shard to look at
-- ARGV[1] hand-off grace (us), ARGV[2] the most resources to pass over per shard, ARGV[3..]
-- the resources to look at (one shard's keys only; none: each shard's wait lists by when their
-- last place lapses, counting only those with a live place and no live lease, reading past at
-- most WAKE_DUE_SKIP held ones)
-- passes the turn on (invariant 16): on each resource with a wait list, no live lease and no
-- wake in flight, every missed wake not sent again yet is marked and returned once more, and
-- the first waiter never woken is woken, as a release wakes it
-- returns {resource1, payload1, again1 (1: a missed wake sent again, 0: woken now), ...}
"""
    + _NOW
    + _PARSE
    + _WAITS
    + f"""
local WAKE_DUE_SKIP = {WAKE_DUE_SKIP}
"""
    + """
-- The first `limit` resources of a shard by when their lists lapse (the index's score: the
-- latest lapse of a line in the list; past now, some place is live) that have no live lease:
-- a held one does not count (its holder's release wakes its next waiter). The index is read
-- in batches, the lease of each name in one HMGET; past WAKE_DUE_SKIP held ones the shard's
-- reading ends (it bounds a call's cost: see _bounds.py).
local function due_names(leases, wexp, limit)
  local names, skipped, offset = {}, 0, 0
  local after = '(' .. fmt(now)
  while true do
    local want = math.min(256, limit - #names + WAKE_DUE_SKIP - skipped)
    local batch = redis.call('ZRANGEBYSCORE', wexp, after, '+inf', 'LIMIT', offset, want)
    if #batch == 0 then return names end
    offset = offset + #batch
    local records = redis.call('HMGET', leases, unpack(batch))
    for j, res in ipairs(batch) do
      local live = false
      if records[j] then
        local _, _, _, e = parse(records[j])
        live = tonumber(e) > now
      end
      if not live then
        names[#names + 1] = res
        if #names >= limit then return names end
      else
        skipped = skipped + 1
        if skipped > WAKE_DUE_SKIP then return names end
      end
    end
    if #batch < want then return names end
  end
end
"""
    + """
local grace = tonumber(ARGV[1])
local out = {}
local function send(res, member, again)
  local payload = redis.call('HGET', member[1], member[2])
  if payload then
    out[#out + 1] = res
    out[#out + 1] = payload
    out[#out + 1] = again
  end
end
local function pass(leases, waits, wpay, wexp, res)
  local cur = redis.call('HGET', leases, res)
  if cur then
    local _, _, _, e = parse(cur)
    if tonumber(e) > now then return end  -- held: its holder's release wakes the next waiter
  end
  local wl, dirty = wl_load(waits, wpay, res, now, 10 * grace)
  for _, w in ipairs(wl) do
    if tonumber(w[4]) > now then  -- a wake in flight: its grace decides
      if dirty then wl_save(waits, wexp, res, wl) end
      return
    end
  end
  local sent, woke = {}, false
  for _, w in ipairs(wl) do
    if tonumber(w[4]) ~= 0 and w[6] ~= '1' then  -- missed its grace: sent once more
      w[6] = '1'
      dirty = true
      sent[#sent + 1] = w[1]
    end
  end
  for _, w in ipairs(wl) do
    if tonumber(w[4]) == 0 then
      wl_wake(w, now + held_for(redis.call('HGET', wpay, res .. '|' .. w[1]), grace))
      woke = w
      dirty = true
      break
    end
  end
  if dirty then wl_save(waits, wexp, res, wl) end
  for _, id in ipairs(sent) do send(res, {wpay, res .. '|' .. id}, 1) end
  if woke then
    redis.call('HSET', waits, '!!' .. res, woke[4])
    send(res, {wpay, res .. '|' .. woke[1]}, 0)
  end
end
for s = 1, #KEYS / 4 do
  local k = 4 * (s - 1)
  local names
  if #ARGV > 2 then
    names = {unpack(ARGV, 3)}
  else
    names = due_names(KEYS[k + 1], KEYS[k + 4], tonumber(ARGV[2]))
  end
  for _, res in ipairs(names) do pass(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], res) end
end
return out
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

SWEEP = (
    """
-- KEYS[8s-7] ids hash, KEYS[8s-6] ids_exp zset, KEYS[8s-5] ckpt hash, KEYS[8s-4] ledger hash,
-- KEYS[8s-3] ledger_exp zset, KEYS[8s-2] waits hash, KEYS[8s-1] wpay hash and KEYS[8s]
-- waits_exp zset of shard s, for every shard to sweep
-- ARGV[1] the most entries to remove
-- removes identity entries (with their checkpoints) and ledger entries past their retention,
-- and wait lists whose every place lapsed, found through their indexes (cost proportional to
-- what is removed)
-- returns how many entries (a wait list counts as one) were removed
"""
    + _NOW
    + _WAITS
    + """
local left = tonumber(ARGV[1])
local removed = 0
local function drop(index, hash1, hash2)
  if left <= 0 then return end
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, left)
  for i = 1, #old, 256 do  -- a bounded number of arguments per command
    local chunk = {unpack(old, i, math.min(i + 255, #old))}
    redis.call('HDEL', hash1, unpack(chunk))
    if hash2 then redis.call('HDEL', hash2, unpack(chunk)) end
    redis.call('ZREM', index, unpack(chunk))
  end
  left = left - #old
  removed = removed + #old
end
for s = 1, #KEYS / 8 do
  local k = 8 * (s - 1)
  drop(KEYS[k + 2], KEYS[k + 1], KEYS[k + 3])
  drop(KEYS[k + 5], KEYS[k + 4], false)
  if left > 0 then
    local lapsed = redis.call('ZRANGEBYSCORE', KEYS[k + 8], '-inf', now, 'LIMIT', 0, left)
    for _, res in ipairs(lapsed) do
      local wl = wl_load(KEYS[k + 6], KEYS[k + 7], res, now, 0)
      wl_save(KEYS[k + 6], KEYS[k + 8], res, wl)
    end
    left = left - #lapsed
    removed = removed + #lapsed
  end
end
return removed
"""
)

GATE_ADMIT = """
-- KEYS[1] gates hash and KEYS[2] fences hash of the key's shard; on a single server also
-- KEYS[3], the key's gate string of the earlier layout (<prefix>gate:<key>), read, never written
-- ARGV[1] the side-effect key, ARGV[2] the fence to admit, ARGV[3] on a cluster (no KEYS[3]):
-- the earlier layout's value as the caller read it ('-': none), or '' when not read yet
-- admits a fence >= the highest admitted for the key (in either layout) and >= the newest
-- fence granted for the key as a lease resource (the fences hash: claims and force-releases)
-- returns {1, fence} when admitted, {0, highest} when the fence is stale (nothing changed), or
-- {2} when ARGV[3] is '' on a cluster and the key has no entry in the gates hash yet: read the
-- earlier layout's string (another slot) and call again with its value
local best, shown = nil, nil
local function consider(value)
  if value then
    local n = tonumber(value)
    if not best or n > best then best, shown = n, value end
  end
end
local admitted = redis.call('HGET', KEYS[1], ARGV[1])
consider(admitted)
if KEYS[3] then
  consider(redis.call('GET', KEYS[3]))
elseif not admitted then
  if ARGV[3] == '' then return {2} end
  if ARGV[3] ~= '-' then consider(ARGV[3]) end
end
consider(redis.call('HGET', KEYS[2], ARGV[1]))
if best and best > tonumber(ARGV[2]) then return {0, shown} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {1, ARGV[2]}
"""

EFFECT_BEGIN = (
    """
-- KEYS[1] leases hash, KEYS[2] ledger hash, KEYS[3] ledger_exp zset, KEYS[4] fences hash
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] fence, ARGV[4] identity, ARGV[5] effect key,
-- ARGV[6] retention (us)
-- proves the lease is live and ours, then records the effect's intent unless it is done
-- returns {1, 'new'} | {1, 'intent', earlier_fence} | {1, 'done', fence, receipt}
--      or {0, reason, holder_label, holder_fence, holder expired 1|0} when the lease is not ours
"""
    + _PRELUDE
    + _GONE
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return {0, gone(KEYS[4], ARGV[1], ARGV[3])} end
local tok, f, a, e, label = parse(cur)
if tok ~= ARGV[2] or f ~= ARGV[3] then
  return {0, 'taken_over', label, tonumber(f), tonumber(e) <= now and 1 or 0}
end
if tonumber(e) <= now then return {0, 'expired'} end
trim(KEYS[3], now, KEYS[2], nil)
local member = ARGV[1] .. '|' .. ARGV[4] .. '|' .. ARGV[5]
local entry = redis.call('HGET', KEYS[2], member)
local kept = redis.call('ZSCORE', KEYS[3], member)
if entry and (not kept or tonumber(kept) <= now) then entry = false end  -- past retention
local earlier = nil
if entry then
  local st, ef, et, receipt = string.match(entry, '^([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n(.*)$')
  if st == 'done' then return {1, 'done', tonumber(ef), receipt} end
  if ef ~= ARGV[3] then earlier = tonumber(ef) end
end
redis.call('HSET', KEYS[2], member, 'intent\\n' .. ARGV[3] .. '\\n' .. ARGV[2] .. '\\n')
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), member)
if earlier then return {1, 'intent', earlier} end
return {1, 'new'}
"""
)

EFFECT_DONE = (
    """
-- KEYS[1] ledger hash, KEYS[2] ledger_exp zset
-- ARGV[1] "<resource>|<identity>|<key>", ARGV[2] fence, ARGV[3] receipt (JSON),
-- ARGV[4] retention (us), ARGV[5] owner token
-- completes the intent recorded with this fence and token; returns 1, or 0 when not ours
"""
    + _PRELUDE
    + """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return 0 end
local st, ef, et = string.match(entry, '^([^\\n]*)\\n([^\\n]*)\\n([^\\n]*)\\n')
if st ~= 'intent' or ef ~= ARGV[2] or et ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], 'done\\n' .. ARGV[2] .. '\\n' .. ARGV[5] .. '\\n' .. ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
return 1
"""
)

CHECKPOINT = (
    """
-- KEYS[1] leases hash, KEYS[2] ckpt hash, KEYS[3] fences hash
-- ARGV[1] resource, ARGV[2] owner token, ARGV[3] fence, ARGV[4] identity, ARGV[5] data (JSON)
-- stores the identity's checkpoints if the lease is live and ours and no newer fence wrote
-- returns {1} or {0, reason, holder_label, holder_fence, holder expired 1|0}
"""
    + _PRELUDE
    + _GONE
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return {0, gone(KEYS[3], ARGV[1], ARGV[3])} end
local tok, f, a, e, label = parse(cur)
if tok ~= ARGV[2] or f ~= ARGV[3] then
  return {0, 'taken_over', label, tonumber(f), tonumber(e) <= now and 1 or 0}
end
if tonumber(e) <= now then return {0, 'expired'} end
local member = ARGV[1] .. '|' .. ARGV[4]
local old = redis.call('HGET', KEYS[2], member)
if old then
  local of = string.match(old, '^(%d+)\\n')
  if tonumber(of) > tonumber(ARGV[3]) then return {0, 'taken_over', false, tonumber(of)} end
end
redis.call('HSET', KEYS[2], member, ARGV[3] .. '\\n' .. ARGV[5])
return {1}
"""
)

IDENTITY_GET = (
    """
-- KEYS[1] ids hash, KEYS[2] ids_exp zset
-- ARGV[1] "<resource>|<identity>"
-- returns {record, expires_us}, or {} when there is none or it is past its retention
"""
    + _PRELUDE
    + """
local record = redis.call('HGET', KEYS[1], ARGV[1])
local kept = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not record or not kept or tonumber(kept) <= now then return {} end
return {record, kept}
"""
)

MARK_ONCE = (
    """
-- KEYS[1] ids hash, KEYS[2] ids_exp zset
-- ARGV[1] "<key>|<mark identity>", ARGV[2] the caller's token, ARGV[3] ttl (us)
-- an identity entry of its own (state 'mark'), taken over only once past its expiry (the
-- sweep removes it then); returns 1 when the caller holds it (also when it held it already)
"""
    + _NOW
    + _IDENT
    + """
local record = redis.call('HGET', KEYS[1], ARGV[1])
local kept = redis.call('ZSCORE', KEYS[2], ARGV[1])
if record and kept and tonumber(kept) > now then
  local _, _, token = parse_ident(record)
  if token ~= ARGV[2] then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], 'mark\\n0\\n' .. ARGV[2] .. '\\n\\n')
redis.call('ZADD', KEYS[2], fmt(now + tonumber(ARGV[3])), ARGV[1])
return 1
"""
)

WAITERS = (
    """
-- KEYS[1] waits hash
-- ARGV[1] resource
-- returns {now_us, wait list text|nil}
"""
    + _NOW
    + """
return {now, redis.call('HGET', KEYS[1], ARGV[1])}
"""
)
