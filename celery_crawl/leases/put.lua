-- KEYS[1] lease key (unused when unfenced), KEYS[2..] record keys
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token, ARGV[3] ttl ms (0 = persistent),
-- ARGV[4..] JSON values, one per record key
-- Records are hashes {v = JSON, t = writer token}. Every fence is checked before any write,
-- so a batch is all-or-nothing. Returns 1, -1 (lease not current), -2 (older token) or -3 (a
-- stored writer token that is not a number: foreign data).
local fenced = ARGV[1] ~= ''
if fenced then
  if not lease_is(KEYS[1], ARGV[1], ARGV[2]) then return -1 end
  for i = 2, #KEYS do
    local t = redis.call('HGET', KEYS[i], 't')
    if t then
      local tn = tonumber(t)
      if not tn then return -3 end
      if tn > tonumber(ARGV[2]) then return -2 end
    end
  end
end
local ttl = tonumber(ARGV[3])
for i = 2, #KEYS do
  if fenced then
    redis.call('HSET', KEYS[i], 'v', ARGV[i + 2], 't', ARGV[2])
  else
    redis.call('HSET', KEYS[i], 'v', ARGV[i + 2])
  end
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
return 1
