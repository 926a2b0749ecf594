-- KEYS[1] lease key, KEYS[2] queue list, KEYS[3..] record keys
-- ARGV[1] holder, ARGV[2] lease token, ARGV[3] n = items taken from the queue's head,
-- ARGV[4 .. 3+n] those items as read, ARGV[4+n ..] JSON values, one per record key
-- Writes the records (fenced, persistent, like put) and removes the n items, only if the lease
-- is current and the head of the queue still holds exactly those items: the effect of the
-- items and their removal are one write. Returns 1, -1 (lease not current), -2 (older token),
-- -3 (foreign writer token) or -4 (the head of the queue changed).
local refused = fence_refused(KEYS[1], ARGV[1], ARGV[2], 3)
if refused then return refused end
local n = tonumber(ARGV[3])
if n > 0 then
  local head = redis.call('LRANGE', KEYS[2], 0, n - 1)
  if #head ~= n then return -4 end
  for i = 1, n do
    if head[i] ~= ARGV[3 + i] then return -4 end
  end
end
for i = 3, #KEYS do
  redis.call('HSET', KEYS[i], 'v', ARGV[n + i + 1], 't', ARGV[2])
  redis.call('PERSIST', KEYS[i])
end
if n > 0 then redis.call('LTRIM', KEYS[2], n, -1) end
return 1
