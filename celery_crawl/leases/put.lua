-- KEYS[1] lease key (unused when unfenced), KEYS[2..] record keys
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token, ARGV[3] ttl ms (0 = persistent),
-- ARGV[4..] JSON values, one per record key
-- Records are hashes {v = JSON, t = writer token}. Every fence is checked before any write,
-- so a batch is all-or-nothing. Returns 1, -1 (lease not current), -2 (older token) or -3 (a
-- stored writer token that is not a number: foreign data).
local fenced = ARGV[1] ~= ''
if fenced then
  local refused = fence_refused(KEYS[1], ARGV[1], ARGV[2], 2)
  if refused then return refused end
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
