-- Prepended to claim.lua as the script claim_unless: one claim, made only if a record is
-- unchanged since the caller read it (the done tombstone a worker decided on), in the same
-- atomic step. The first key and the first argument are the guard's; they are taken off before
-- claim.lua's body runs, so that body sees its own KEYS and ARGV (previous claimants' lease keys
-- included, see claim.lua).
-- KEYS[1] record key, ARGV[1] the record's JSON as read ('' = it was absent)
-- Returns {-3} when the record changed (nothing written), else what claim.lua returns.
local guard_key = table.remove(KEYS, 1)
local expected = table.remove(ARGV, 1)
local current = redis.pcall('HGET', guard_key, 'v')
if type(current) == 'table' then return {-3} end
if (current or '') ~= expected then return {-3} end
