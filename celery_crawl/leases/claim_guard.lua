-- Prepended to claim.lua as the script claim_unless: one claim, made only if some records are
-- unchanged since the caller read them (the done tombstone a worker decided on, and the task's
-- delivery count), in the same atomic step. The guard's keys are the last n KEYS and its
-- arguments the last n + 1 ARGV (the n versions, then n); they are taken off before
-- claim.lua's body runs, so that body sees its own KEYS and ARGV.
-- KEYS[#KEYS - n + 1 ..] record keys, ARGV[#ARGV - n .. #ARGV - 1] each record's JSON as read
-- ('' = it was absent), ARGV[#ARGV] n
-- Returns {-2, i} when record i (1-based among the guarded) changed (nothing written), else
-- what claim.lua returns.
local n = tonumber(table.remove(ARGV))
local guard_keys, expected = {}, {}
for i = n, 1, -1 do
  guard_keys[i] = table.remove(KEYS)
  expected[i] = table.remove(ARGV)
end
for i = 1, n do
  local current = redis.pcall('HGET', guard_keys[i], 'v')
  if type(current) == 'table' then return {-2, i} end
  if (current or '') ~= expected[i] then return {-2, i} end
end
