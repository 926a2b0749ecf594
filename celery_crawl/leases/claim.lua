-- KEYS[1] lease key, KEYS[2] token counter, KEYS[3] claims-of set of this lease,
-- KEYS[4] index of lease names having claims (zset, score = smallest lease token among the
-- name's claims, see orphans.lua), KEYS[5..] claim keys
-- ARGV[1] lease name, ARGV[2] holder, ARGV[3] lease token, ARGV[4] namespace prefix ("ns:"),
-- ARGV[5..4+n] claim values (JSON), one per claim key
-- then, for previous claimants' leases the caller knows of: KEYS (lease key, claims-of set)
-- pairs after the claim keys and their lease names after the values (m of them), so
-- #ARGV - 4 = n + m and #KEYS - 4 = n + 2m
-- Returns {-1} when the lease is not held, {-2, name, ...} when a claim's previous claimant's
-- lease was not passed (nothing written; the caller passes those keys and calls again: every
-- key touched is declared), else {1, t1, t2, ...} with 0 for a refused claim.
-- A claim is alive iff its lease key holds the claim's holder AND lease token: a lease that
-- expired and was re-taken by the same holder is a new lease and does not revive old claims.
local bad, counted = bad_counter(KEYS[2])
if bad then return redis.error_reply(bad) end
local counter = {last = counted}
if not lease_is(KEYS[1], ARGV[2], ARGV[3]) then return {-1} end
local nclaims = 2 * (#ARGV - 4) - (#KEYS - 4)
local lease_keys = {[ARGV[1]] = {KEYS[1], KEYS[3]}}
for j = 1, #KEYS - 4 - nclaims, 2 do
  lease_keys[ARGV[4 + nclaims + (j + 1) / 2]] = {KEYS[4 + nclaims + j], KEYS[5 + nclaims + j]}
end
local missing = {-2}
-- Each claim key as found (nil: not a hash), read once; a key named twice is read again after
-- this script wrote it.
local found = {}
for i = 5, 4 + nclaims do
  found[i] = hmget_safe(KEYS[i], 'lease', 'holder', 'ltoken')
  local prev = found[i] or {}
  if prev[1] and not lease_keys[prev[1]] then missing[#missing + 1] = prev[1] end
end
if #missing > 1 then return missing end
local out = {1}
local granted = 0
local written = {}
for i = 5, 4 + nclaims do
  local ck = KEYS[i]
  local raw = found[i]
  if written[ck] then raw = hmget_safe(ck, 'lease', 'holder', 'ltoken') end
  -- A key that is not a claim hash is foreign data: taken over like a dead claim.
  local prev = raw or {}
  local free = true
  if prev[1] then
    local pkeys = lease_keys[prev[1]]
    if lease_alive(pkeys[1], prev[2], prev[3]) then
      free = false
    else
      local pset = pkeys[2]
      redis.pcall('SREM', pset, ck)
      if prev[1] ~= ARGV[1] and redis.pcall('SCARD', pset) == 0 then
        redis.call('ZREM', KEYS[4], prev[1])
      end
    end
  end
  if free then
    local token = issue_token(KEYS[2], counter)
    -- A missing key needs no DEL; a dead claim or foreign data is replaced whole.
    if raw == nil or prev[1] or prev[2] or prev[3] then redis.call('DEL', ck) end
    written[ck] = true
    redis.call('HSET', ck, 'lease', ARGV[1], 'holder', ARGV[2], 'ltoken', ARGV[3],
               'token', token, 'value', ARGV[i])
    redis.call('SADD', KEYS[3], ck)
    out[#out + 1] = token
    granted = granted + 1
  else
    out[#out + 1] = 0
  end
end
if granted ~= 0 then redis.call('ZADD', KEYS[4], 'LT', ARGV[3], ARGV[1]) end
return out
