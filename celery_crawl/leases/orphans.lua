-- KEYS[1] index of lease names having claims (zset, score = smallest lease token among the
-- name's claims); ARGV[1] namespace prefix, ARGV[2] limit
-- Walks lease names oldest first and returns claims whose lease is gone or was re-taken (other
-- holder or token). A name whose live lease token is <= its score has only claims made under
-- that live lease, so it is skipped without reading its claims: a reaper pass costs O(leases)
-- plus O(claims of dead leases), not O(all claims). Scanned names get their score recomputed
-- and empty ones leave the index. Returns the same flat shape as read_claims.lua.
local limit = tonumber(ARGV[2])
local out = {}
local n = 0
local names = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #names, 2 do
  if n >= limit then break end
  local name = names[i]
  local score = tonumber(names[i + 1])
  local cur = redis.call('HMGET', ARGV[1] .. 'lease:' .. name, 'holder', 'token')
  if not (cur[2] and tonumber(cur[2]) <= score) then
    local set = ARGV[1] .. 'claims-of:' .. name
    local members = redis.call('SMEMBERS', set)
    local low = nil
    local complete = true
    for _, ck in ipairs(members) do
      local c = redis.call('HMGET', ck, 'lease', 'holder', 'token', 'value', 'ltoken')
      if not c[1] or c[1] ~= name then
        redis.call('SREM', set, ck)
      else
        local lt = tonumber(c[5])
        if low == nil or lt < low then low = lt end
        if cur[1] ~= c[2] or cur[2] ~= c[5] then
          if n < limit then
            out[#out + 1] = ck
            out[#out + 1] = c[1]
            out[#out + 1] = c[2]
            out[#out + 1] = c[3]
            out[#out + 1] = c[4]
            out[#out + 1] = 0
            n = n + 1
          else
            complete = false
          end
        end
      end
    end
    if low == nil then
      redis.call('ZREM', KEYS[1], name)
    elseif complete then
      redis.call('ZADD', KEYS[1], 'XX', low, name)
    end
  end
end
return out
