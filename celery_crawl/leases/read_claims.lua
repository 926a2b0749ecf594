-- Read claims with their liveness in one round trip.
-- KEYS[1..] claim keys (may be empty when ARGV[2] names a claims-of set)
-- ARGV[1] namespace prefix, ARGV[2] '' or a claims-of set key to read every member of
-- Returns a flat list: key, lease, holder, token, value, alive per existing claim; alive is 1,
-- 0, or -1 when the key is not a claim hash (foreign data; the caller decides to name or skip).
local keys = KEYS
if ARGV[2] ~= '' then
  keys = redis.pcall('SMEMBERS', ARGV[2])
  if type(keys) == 'table' and keys.err then keys = {} end
end
local out = {}
for _, ck in ipairs(keys) do
  local c = hmget_safe(ck, 'lease', 'holder', 'token', 'value', 'ltoken')
  if c == nil then
    claim_row(out, ck, {}, -1)
  elseif c[1] then
    claim_row(out, ck, c, claim_alive(ARGV[1], c[1], c[2], c[5]) and 1 or 0)
  end
end
return out
