-- KEYS[1] claim key, KEYS[2] claims-of set of the lease, KEYS[3] index zset
-- ARGV[1] lease name, ARGV[2] holder, ARGV[3] expected claim token ('' = any)
-- unclaim: ARGV[3] = '' and lease/holder must match; drop_claim: token must match.
local c = redis.call('HMGET', KEYS[1], 'lease', 'holder', 'token')
if not c[1] or c[1] ~= ARGV[1] or c[2] ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and c[3] ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('ZREM', KEYS[3], ARGV[1]) end
return 1
