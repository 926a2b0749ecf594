-- KEYS[1] index of lease names having claims (zset, score = first claim token)
-- ARGV[1] namespace prefix, ARGV[2] limit
-- Walks lease names oldest first; returns the claims whose lease is gone or was re-taken (other
-- holder or token). Empty claims-of sets are dropped from the index on the way.
-- Returns the same flat shape as read_claims.lua.
local limit = tonumber(ARGV[2])
local out = {}
local n = 0
local names = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, name in ipairs(names) do
  if n >= limit then break end
  local set = ARGV[1] .. 'claims-of:' .. name
  local members = redis.call('SMEMBERS', set)
  if #members == 0 then
    redis.call('ZREM', KEYS[1], name)
  else
    local cur = redis.call('HMGET', ARGV[1] .. 'lease:' .. name, 'holder', 'token')
    for _, ck in ipairs(members) do
      if n >= limit then break end
      local c = redis.call('HMGET', ck, 'lease', 'holder', 'token', 'value', 'ltoken')
      if not c[1] or c[1] ~= name then
        redis.call('SREM', set, ck)
      elseif cur[1] ~= c[2] or cur[2] ~= c[5] then
        out[#out + 1] = ck
        out[#out + 1] = c[1]
        out[#out + 1] = c[2]
        out[#out + 1] = c[3]
        out[#out + 1] = c[4]
        out[#out + 1] = 0
        n = n + 1
      end
    end
  end
end
return out
