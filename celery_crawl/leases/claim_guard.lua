-- Prepended to claim.lua as the script claim_unless: one claim, made only if some records are
-- unchanged since the caller read them (the done tombstone a worker decided on, and the task's
-- delivery count), in the same atomic step. The guard's keys are the first n KEYS and its
-- arguments the first n + 1 ARGV (n, then the n versions); they are taken off before claim.lua's
-- body runs, so that body sees its own KEYS and ARGV (previous claimants' lease keys included,
-- see claim.lua).
-- ARGV[1] n, KEYS[1..n] record keys, ARGV[2..n+1] each record's JSON as read ('' = absent)
-- Returns {-3, i} when record i (1-based among the guarded) changed (nothing written), else
-- what claim.lua returns.
local n = tonumber(table.remove(ARGV, 1))
local guard_keys, expected = {}, {}
for i = 1, n do
  guard_keys[i] = table.remove(KEYS, 1)
  expected[i] = table.remove(ARGV, 1)
end
-- Most guards expect every record absent: one EXISTS says so; otherwise each is looked at.
local all_absent = n > 0
for i = 1, n do
  if expected[i] ~= '' then all_absent = false end
end
if all_absent and redis.call('EXISTS', unpack(guard_keys)) == 0 then n = 0 end
for i = 1, n do
  local current = redis.pcall('HGET', guard_keys[i], 'v')
  if type(current) == 'table' then return {-3, i} end
  if (current or '') ~= expected[i] then return {-3, i} end
end
