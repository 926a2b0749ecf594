-- KEYS[1] lease key (unused when unfenced), KEYS[2] record key
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token
-- Returns 1 deleted, 0 absent, -1 lease not current, -2 older token, -3 garbage writer token.
if ARGV[1] ~= '' then
  local refused = fence_refused(KEYS[1], ARGV[1], ARGV[2], 2)
  if refused then return refused end
end
return redis.call('DEL', KEYS[2])
