-- KEYS[1] lease key ('' when unfenced), KEYS[2] record key
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token
-- Returns 1 deleted, 0 absent, -1 lease not current, -2 older token.
if ARGV[1] ~= '' then
  if not lease_is(KEYS[1], ARGV[1], ARGV[2]) then return -1 end
  local t = redis.call('HGET', KEYS[2], 't')
  if t and tonumber(t) > tonumber(ARGV[2]) then return -2 end
end
return redis.call('DEL', KEYS[2])
