-- Read claims with their liveness in one round trip.
-- KEYS[1..] claim keys (may be empty when ARGV[2] names a claims-of set)
-- ARGV[1] namespace prefix, ARGV[2] '' or a claims-of set key to read every member of
-- Returns a flat list: key, lease, holder, token, value, alive(0/1) per existing claim.
local keys = KEYS
if ARGV[2] ~= '' then keys = redis.call('SMEMBERS', ARGV[2]) end
local out = {}
for _, ck in ipairs(keys) do
  local c = redis.call('HMGET', ck, 'lease', 'holder', 'token', 'value', 'ltoken')
  if c[1] then
    local alive = 0
    local cur = redis.call('HMGET', ARGV[1] .. 'lease:' .. c[1], 'holder', 'token')
    if cur[1] == c[2] and cur[2] == c[5] then alive = 1 end
    out[#out + 1] = ck
    out[#out + 1] = c[1]
    out[#out + 1] = c[2]
    out[#out + 1] = c[3]
    out[#out + 1] = c[4]
    out[#out + 1] = alive
  end
end
return out
