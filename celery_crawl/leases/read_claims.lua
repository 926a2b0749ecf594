-- Read claims with their liveness in one round trip.
-- KEYS[1..n] claim keys, KEYS[n+1..] lease keys of their claimants (as far as the caller knows)
-- ARGV[1] namespace prefix, ARGV[2] n, ARGV[3] '1': skip a claim whose lease key was not passed
-- (claims_of: only the claims of the passed lease are wanted), else report it
-- Returns {1, rows...} with a flat row per existing claim: key, lease, holder, token, value,
-- alive (1, 0, or -1 when the key is not a claim hash: foreign data, the caller decides to name
-- or skip); or {0, lease name, ...} when claims name lease keys that were not passed (the
-- caller passes them and asks again: every key touched is declared).
local n = tonumber(ARGV[2])
local leases = declared_keys(n + 1)
local skip = ARGV[3] == '1'
local out, missing = {1}, {}
for i = 1, n do
  local ck = KEYS[i]
  local c = hmget_safe(ck, 'lease', 'holder', 'token', 'value', 'ltoken')
  if c == nil then
    claim_row(out, ck, {}, -1)
  elseif c[1] then
    local lk = ARGV[1] .. 'lease:' .. c[1]
    if leases[lk] then
      claim_row(out, ck, c, lease_alive(lk, c[2], c[5]) and 1 or 0)
    elseif not skip then
      missing[#missing + 1] = c[1]
    end
  end
end
if #missing > 0 then
  table.insert(missing, 1, 0)
  return missing
end
return out
