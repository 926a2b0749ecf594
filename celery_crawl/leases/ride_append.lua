-- Prepended to claim_guard.lua + claim.lua as the script ride_claim (worker/riding.py): the
-- broker's record of a delivery as unacked (kombu's Redis QoS: ZADD to its unacked index,
-- HSET of its unacked entry, as kombu's own MULTI/EXEC writes them), then the delivery's claim,
-- in one atomic script instead of a transaction plus a script.
-- KEYS[1] unacked index (zset), KEYS[2] unacked hash; ARGV[1] delivery tag, ARGV[2] score
-- (UNIX time), ARGV[3] the unacked entry. They are taken off before the rest runs, so it sees
-- its own KEYS and ARGV.
-- Returns an error starting 'KOMBU ' when the broker's writes failed (nothing else ran), else
-- what the claim returns. The broker's writes stand whatever the claim does.
local unacked_index = table.remove(KEYS, 1)
local unacked = table.remove(KEYS, 1)
local tag = table.remove(ARGV, 1)
local score = table.remove(ARGV, 1)
local entry = table.remove(ARGV, 1)
local got = redis.pcall('ZADD', unacked_index, score, tag)
if type(got) == 'table' and got.err then return redis.error_reply('KOMBU ' .. got.err) end
got = redis.pcall('HSET', unacked, tag, entry)
if type(got) == 'table' and got.err then return redis.error_reply('KOMBU ' .. got.err) end
