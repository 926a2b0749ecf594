-- The end of a claimed run in one atomic step: a record written (the done tombstone, or the
-- delivery count of a requeued task), then the claim deleted if it is still bound to the lease.
-- The record is written first, so nobody sees "no claim" without it.
-- KEYS[1] record key, KEYS[2] claim key, KEYS[3] claims-of set of the lease, KEYS[4] index zset
-- ARGV[1] record JSON, ARGV[2] record ttl ms (0 = persistent), ARGV[3] lease name,
-- ARGV[4] holder, ARGV[5] lease token, ARGV[6] claim token ('' only for a caller that owns the
-- key outright): the end names the exact claim it ends, so a late end of an earlier run never
-- deletes a later claim of the same lease.
-- Returns 1 if the claim was deleted, 0 if it was not ours (the record is written either way).
redis.call('HSET', KEYS[1], 'v', ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) else redis.call('PERSIST', KEYS[1]) end
local c = hmget_safe(KEYS[2], 'lease', 'holder', 'ltoken', 'token')
if c == nil or not c[1] or c[1] ~= ARGV[3] or c[2] ~= ARGV[4] or c[3] ~= ARGV[5] then
  return 0
end
if ARGV[6] and ARGV[6] ~= '' and c[4] ~= ARGV[6] then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], KEYS[2])
if redis.call('SCARD', KEYS[3]) == 0 then redis.call('ZREM', KEYS[4], ARGV[3]) end
return 1
