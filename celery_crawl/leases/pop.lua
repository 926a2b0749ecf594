-- KEYS[1] lease key (unused when unfenced), KEYS[2] queue list
-- ARGV[1] holder ('' = unfenced), ARGV[2] lease token, ARGV[3] limit
-- Returns {-1} when the lease is not current, else {1, item, item, ...}.
if ARGV[1] ~= '' and not lease_is(KEYS[1], ARGV[1], ARGV[2]) then return {-1} end
local n = tonumber(ARGV[3])
local items = redis.call('LRANGE', KEYS[2], 0, n - 1)
if #items > 0 then redis.call('LTRIM', KEYS[2], #items, -1) end
table.insert(items, 1, 1)
return items
