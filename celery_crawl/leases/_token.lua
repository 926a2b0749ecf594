-- Shared prelude (prepended to the scripts that issue tokens).
-- next_token(counter_key): the namespace's single fencing-token source. When the counter is
-- missing (restart without persistence, failover to a replica that never saw it) it is re-seeded
-- from the server's TIME in microseconds, which is larger than any count issued before the reset
-- as long as fewer than one token per microsecond was issued since the counter was first seeded.
local function next_token(counter_key)
  if redis.call('EXISTS', counter_key) == 0 then
    local t = redis.call('TIME')
    local seed = tonumber(t[1]) * 1000000 + tonumber(t[2])
    redis.call('SET', counter_key, seed)
    return seed
  end
  return redis.call('INCR', counter_key)
end

-- lease_is(lease_key, holder, token): the lease key exists and names this holder (and token,
-- when token is not the empty string).
local function lease_is(lease_key, holder, token)
  local v = redis.call('HMGET', lease_key, 'holder', 'token')
  if not v[1] or v[1] ~= holder then return false end
  if token ~= '' and v[2] ~= token then return false end
  return true
end
