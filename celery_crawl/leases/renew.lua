-- KEYS[1] lease key; ARGV[1] holder, ARGV[2] token, ARGV[3] ttl ms
-- O(1) whatever the number of claims: claims are bound to the lease, never refreshed.
if lease_is(KEYS[1], ARGV[1], ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
