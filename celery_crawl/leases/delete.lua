-- KEYS[1] lease key (unused when unfenced), KEYS[2] record key
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token
-- Returns 1 deleted, 0 absent, -1 lease not current, -2 older token, -3 garbage writer token.
if ARGV[1] ~= '' then
  if not lease_is(KEYS[1], ARGV[1], ARGV[2]) then return -1 end
  local t = redis.call('HGET', KEYS[2], 't')
  if t then
    local tn = tonumber(t)
    if not tn then return -3 end
    if tn > tonumber(ARGV[2]) then return -2 end
  end
end
return redis.call('DEL', KEYS[2])
