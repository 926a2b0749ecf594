-- KEYS[1] lease key, KEYS[2] token counter
-- ARGV[1] holder, ARGV[2] ttl ms
-- Returns {token, 1} when newly taken, {token, 0} when this holder already held it (an
-- idempotent retry after a timed-out acquire), or false while another holder has it.
local bad = bad_counter(KEYS[2])
if bad then return redis.error_reply(bad) end
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if cur[1] then
  if cur[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {tonumber(cur[2]), 0}
  end
  return false
end
local token = next_token(KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {token, 1}
