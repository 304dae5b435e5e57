-- stormguard fleet lease: one call per instance per interval, never on the request path.
-- Grants this instance's share of the fleet's cap slots and reserve tokens, on Redis's own clock.
-- KEYS: 1 slots hash, 2 tokens hash, 3 epoch (all with one {hash tag} per dependency).
-- ARGV: 1 instance, 2 slots committed (what it may hold now), 3 slots wanted (in flight +
-- queued + 1), 4 fleet cap, 5 lease ttl (ms), 6 tokens spent since its last report, 7 tokens
-- committed (unspent of its current allowance), 8 tokens wanted, 9 reserve (tokens per window),
-- 10 window (ms).
-- Returns: epoch, quiet (0/1), slot ceiling, slot record, token allowance, Redis time (ms),
-- live instances.
-- Invariant: the records of live instances add up to at most the cap (the same for token
-- allowances plus tokens spent in the window and the reserve). A record is never below what its
-- instance may still hold, so a shrink is a lower ceiling first and a lower record at the next
-- call, once the instance has had the chance to drain.
local slots_key, tokens_key, epoch_key = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local committed = tonumber(ARGV[2]) or 0
local want = tonumber(ARGV[3]) or 0
local cap = tonumber(ARGV[4]) or 0
local ttl = tonumber(ARGV[5]) or 1000
local spent = tonumber(ARGV[6]) or 0
local tcommitted = tonumber(ARGV[7]) or 0
local twant = tonumber(ARGV[8]) or 0
local reserve = tonumber(ARGV[9]) or 0
local window = tonumber(ARGV[10]) or 10000

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- A missing epoch means a Redis that never held one or lost its data: either way the instances
-- still holding leases must re-assert them before anything new is granted, for one lease ttl.
local epoch = redis.call('GET', epoch_key)
if not epoch then
  epoch = tostring(now)
  redis.call('SET', epoch_key, epoch)
end
local quiet = 0
if now < (tonumber(epoch) or 0) + ttl then quiet = 1 end

-- Slots: what the other live instances hold, and what they want.
local others, wants = 0, {}
local flat = redis.call('HGETALL', slots_key)
for i = 1, #flat, 2 do
  local rec, w, exp = string.match(flat[i + 1], '^(%d+):(%d+):(%d+)$')
  if rec == nil or tonumber(exp) <= now then
    redis.call('HDEL', slots_key, flat[i])
  elseif flat[i] ~= id then
    others = others + tonumber(rec)
    wants[#wants + 1] = tonumber(w)
  end
end
wants[#wants + 1] = want
-- Max-min fair shares of the cap over what each live instance wants (water-filling); what
-- nobody wants is spread evenly, so a quiet instance still has a slot ready.
table.sort(wants)
local n, left, mine = #wants, cap, nil
for k = 1, n do
  local a = math.min(wants[k], math.floor(left / (n - k + 1)))
  left = left - a
  if mine == nil and wants[k] == want then mine = a end
end
local target = (mine or 0) + math.floor(left / n)
local free = cap - others
if free < 0 then free = 0 end
local ceiling = math.min(target, free)
if quiet == 1 then ceiling = math.min(ceiling, committed) end
local record = math.max(committed, ceiling)
redis.call('HSET', slots_key, id, record .. ':' .. want .. ':' .. (now + ttl))
redis.call('PEXPIRE', slots_key, ttl * 4)

-- Tokens: spent in the window (slices of window/10, like the local ratio budget) plus the
-- allowances other instances hold, against the reserve.
local slice = math.max(1, math.floor(window / 10))
local cur = math.floor(now / slice)
local used, outstanding = 0, 0
local tflat = redis.call('HGETALL', tokens_key)
for i = 1, #tflat, 2 do
  local f, v = tflat[i], tflat[i + 1]
  local s = string.match(f, '^s:(%d+)$')
  if s then
    if tonumber(s) <= cur - 10 then
      redis.call('HDEL', tokens_key, f)
    else
      used = used + (tonumber(v) or 0)
    end
  else
    local alloc, exp = string.match(v, '^(%d+):(%d+)$')
    if alloc == nil or tonumber(exp) <= now then
      redis.call('HDEL', tokens_key, f)
    elseif f ~= 'a:' .. id then
      outstanding = outstanding + tonumber(alloc)
    end
  end
end
if spent > 0 then
  redis.call('HINCRBY', tokens_key, 's:' .. cur, spent)
  used = used + spent
end
local avail = reserve - used - outstanding
if avail < 0 then avail = 0 end
local grant = math.min(twant, avail)
if quiet == 1 then grant = 0 end
local trecord = math.max(tcommitted, grant)
if trecord > 0 then
  redis.call('HSET', tokens_key, 'a:' .. id, trecord .. ':' .. (now + ttl))
else
  redis.call('HDEL', tokens_key, 'a:' .. id)
end
redis.call('PEXPIRE', tokens_key, math.max(ttl, window) * 2)

return {epoch, quiet, ceiling, record, trecord, now, n}
