-- KEYS[1] index of lease names having claims (zset, score = smallest lease token among the
-- name's claims); ARGV[1] namespace prefix, ARGV[2] limit
-- Walks lease names oldest first and returns claims whose lease is gone or was re-taken (other
-- holder or token). A name whose live lease token is <= its score has only claims made under
-- that live lease, so it is skipped without reading its claims: a reaper pass costs O(leases)
-- plus O(claims of dead leases), not O(all claims). Scanned names get their score recomputed
-- and empty ones leave the index. Foreign data is skipped, never fatal: one forged entry must
-- not stop the recovery of real orphans. Returns the same flat shape as read_claims.lua.
local limit = tonumber(ARGV[2])
local out = {}
local n = 0
local names = redis.pcall('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
if type(names) == 'table' and names.err then return out end
for i = 1, #names, 2 do
  if n >= limit then break end
  local name = names[i]
  local score = tonumber(names[i + 1]) or 0
  local cur = hmget_safe(ARGV[1] .. 'lease:' .. name, 'holder', 'token') or {}
  if not (cur[2] and tonumber(cur[2]) and tonumber(cur[2]) <= score) then
    local set = ARGV[1] .. 'claims-of:' .. name
    local members = redis.pcall('SMEMBERS', set)
    if type(members) == 'table' and members.err then members = {} end
    local low = nil
    local complete = true
    for _, ck in ipairs(members) do
      local c = hmget_safe(ck, 'lease', 'holder', 'token', 'value', 'ltoken')
      if c == nil or not c[1] or c[1] ~= name then
        if c ~= nil then redis.call('SREM', set, ck) end
      else
        local lt = tonumber(c[5]) or 0
        if low == nil or lt < low then low = lt end
        if not claim_alive(ARGV[1], c[1], c[2], c[5]) then
          if n < limit then
            claim_row(out, ck, c, 0)
            n = n + 1
          else
            complete = false
          end
        end
      end
    end
    if low == nil then
      if #members == 0 then redis.call('ZREM', KEYS[1], name) end
    elseif complete then
      redis.call('ZADD', KEYS[1], 'XX', low, name)
    end
  end
end
return out
