-- Bookkeeping of one run of an idempotency key (see idem_begin.lua for the record's fields).
--
-- KEYS: 1 the key's record (hash)
-- ARGV: 1 op, 2 run id, 3 heartbeat TTL (ms), then per op:
--   touch                      extend the owner's heartbeat; 0 when another run owns the key
--   release                    forget the key (the run will be retried); 0 when not the owner
--   rb_begin  4 token, 5 final ('1' | '0'), 6 failure (JSON)
--             -> 'done' (already rolled back for this token), 'fenced' (final, not the owner)
--                or 'go' (marked pending)
--   rb_end    4 token, 5 final, 6 status (done | failed)
local ekey, op, owner, hb_ms = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local is_owner = redis.call('HGET', ekey, 'owner') == owner

if op == 'touch' then
  if not is_owner then return 0 end
  redis.call('HSET', ekey, 'hb', now + hb_ms)
  return 1
elseif op == 'release' then
  if not is_owner then return 0 end
  redis.call('DEL', ekey)
  return 1
elseif op == 'rb_begin' then
  local token, final, exc = ARGV[4], ARGV[5], ARGV[6]
  local field = 'rb:' .. token
  if redis.call('HGET', ekey, field) == 'done' then return 'done' end
  if final == '1' then
    if not is_owner then return 'fenced' end
    redis.call('HSET', ekey, 'rbp', token, 'exc', exc, 'hb', now + hb_ms)
  end
  redis.call('HSET', ekey, field, 'pending')
  return 'go'
elseif op == 'rb_end' then
  local token, final, status = ARGV[4], ARGV[5], ARGV[6]
  redis.call('HSET', ekey, 'rb:' .. token, status)
  if final == '1' then redis.call('HSET', ekey, 'fin', status) end
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
