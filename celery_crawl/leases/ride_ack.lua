-- Prepended to finish.lua as the script ride_finish (worker/riding.py): the broker's ack of a
-- delivery (kombu's Redis QoS: ZREM from its unacked index, HDEL of its unacked entry) and the
-- end of the run it carried, in one atomic script instead of a transaction plus a script.
-- KEYS[1] unacked index (zset), KEYS[2] unacked hash; ARGV[1] delivery tag. They are taken off
-- before the rest runs, so it sees its own KEYS and ARGV.
-- Returns an error starting 'KOMBU ' when the broker's writes failed (nothing else ran), else
-- what finish.lua returns. The ack stands whatever the end does (as in kombu's transaction).
local unacked_index = table.remove(KEYS, 1)
local unacked = table.remove(KEYS, 1)
local tag = table.remove(ARGV, 1)
local got = redis.pcall('ZREM', unacked_index, tag)
if type(got) == 'table' and got.err then return redis.error_reply('KOMBU ' .. got.err) end
got = redis.pcall('HDEL', unacked, tag)
if type(got) == 'table' and got.err then return redis.error_reply('KOMBU ' .. got.err) end
