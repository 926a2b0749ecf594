-- KEYS[1] index of lease names having claims (zset, score = smallest lease token among the
-- name's claims); then one group per lease name: its lease key, its claims-of set, and the
-- set's members as the caller read them
-- ARGV[1] limit; then per group: lease name, its score as the caller read it, number of member
-- keys passed
-- Returns claims whose lease is gone or was re-taken (other holder or token), in the flat shape
-- of read_claims.lua. The caller read the index, the lease keys and the sets first (every key
-- touched here is declared) and passed only names it must scan: a name whose live lease token
-- is <= its score has only claims made under that live lease, so a reaper pass costs
-- O(leases) plus O(claims of dead leases), not O(all claims). Everything is checked again
-- here: a name whose lease was re-taken since is judged by its current lease; a member added since the caller read
-- the set is left to the next pass (and the name's score is then not recomputed). Scanned
-- names get their score recomputed and empty ones leave the index. Foreign data is skipped,
-- never fatal: one forged entry must not stop the recovery of real orphans.
local limit = tonumber(ARGV[1])
local out = {}
local n = 0
local k = 2
for a = 2, #ARGV, 3 do
  local name, score, count = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local lkey, set = KEYS[k], KEYS[k + 1]
  local passed = {}
  for i = k + 2, k + 1 + count do passed[KEYS[i]] = true end
  k = k + 2 + count
  if n >= limit then break end
  -- A score read earlier is at most the current one (a name's claims are made under ever newer
  -- lease tokens; only a recomputation raises it), so judging by it scans, never skips, more.
  local cur = hmget_safe(lkey, 'holder', 'token') or {}
  if score and not (cur[2] and tonumber(cur[2]) and tonumber(cur[2]) <= score) then
    local members = redis.pcall('SMEMBERS', set)
    if type(members) == 'table' and members.err then members = {} end
    local low = nil
    local complete = true
    for _, ck in ipairs(members) do
      if not passed[ck] then
        complete = false
      else
        local c = hmget_safe(ck, 'lease', 'holder', 'token', 'value', 'ltoken')
        if c == nil or not c[1] or c[1] ~= name then
          if c ~= nil then redis.call('SREM', set, ck) end
        else
          local lt = tonumber(c[5]) or 0
          if low == nil or lt < low then low = lt end
          if not lease_alive(lkey, c[2], c[5]) then
            if n < limit then
              claim_row(out, ck, c, 0)
              n = n + 1
            else
              complete = false
            end
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
