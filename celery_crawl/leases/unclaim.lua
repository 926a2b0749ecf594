-- KEYS[1] claim key, KEYS[2] claims-of set of the lease, KEYS[3] index zset, KEYS[4] lease key
-- ARGV[1] lease name, ARGV[2] holder, ARGV[3] mode, ARGV[4] token, ARGV[5] claim token
-- mode 'unclaim': the claim must be bound to this lease (name, holder, ARGV[4] = lease token)
-- and, unless ARGV[5] is '', carry claim token ARGV[5] (the exact claim being given back).
-- mode 'drop': the claim must still carry claim token ARGV[4] and its lease must be dead.
local c = hmget_safe(KEYS[1], 'lease', 'holder', 'token', 'ltoken')
if c == nil or not c[1] or c[1] ~= ARGV[1] or c[2] ~= ARGV[2] then return 0 end
if ARGV[3] == 'unclaim' then
  if c[4] ~= ARGV[4] then return 0 end
  if ARGV[5] and ARGV[5] ~= '' and c[3] ~= ARGV[5] then return 0 end
else
  if c[3] ~= ARGV[4] then return 0 end
  if lease_alive(KEYS[4], c[2], c[4]) then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('ZREM', KEYS[3], ARGV[1]) end
return 1
