-- Prepended to claim.lua as the script claim_unless: one claim, made only if a record is
-- unchanged since the caller read it (the done tombstone a worker decided on), in the same
-- atomic step. The last key and the last argument are the guard's; they are taken off before
-- claim.lua's body runs, so that body sees its own KEYS and ARGV.
-- KEYS[#KEYS] record key, ARGV[#ARGV] the record's JSON as read ('' = it was absent)
-- Returns {-2} when the record changed (nothing written), else what claim.lua returns.
local guard_key = table.remove(KEYS)
local expected = table.remove(ARGV)
local current = redis.pcall('HGET', guard_key, 'v')
if type(current) == 'table' then return {-2} end
if (current or '') ~= expected then return {-2} end
