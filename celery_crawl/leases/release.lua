-- KEYS[1] lease key; ARGV[1] holder, ARGV[2] token, ARGV[3] release channel, ARGV[4] lease name
if lease_is(KEYS[1], ARGV[1], ARGV[2]) then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
return 0
