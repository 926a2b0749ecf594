-- Bookkeeping of one run of an idempotency key (see idem_begin.lua for the record's fields).
--
-- KEYS: 1 the key's record (hash)
-- ARGV: 1 op, 2 run id, 3 heartbeat TTL (ms), then per op:
--   touch                      extend the owner's heartbeat; 0 when another run owns the key
--   release                    forget the key (the run will be retried); 0 when not the owner
--   rb_begin  4 token, 5 final ('1' | '0'), 6 failure (JSON), 7 waited ('1': this run saw the
--             rollback pending under another run and waited for it)
--             -> 'done' (already rolled back for this token), 'failed' (waited, and the run it
--                waited for gave up), 'fenced' (final, not the owner), 'wait' (another run holds
--                the token's rollback lock and its lock has not expired) or 'go' (this run
--                now holds the lock: marked pending, lock expiry now + heartbeat TTL)
--   rb_touch  4 token -> 1 (lock extended to now + heartbeat TTL) or 0 (this run lost it)
--   rb_end    4 token, 5 final, 6 status (done | failed)
-- The rollback lock of a token is rb:<token> = pending with rbo:<token> (the holding run) and
-- rbx:<token> (server ms until which it holds it). The holder extends it every TTL/3 while it
-- rolls back; one that died releases it by expiry, so a second caller waits instead of running
-- the same rollback at the same time, and takes over only once the holder is gone.
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
  local token, final, exc, waited = ARGV[4], ARGV[5], ARGV[6], ARGV[7] == '1'
  local field = 'rb:' .. token
  local st = redis.call('HGET', ekey, field)
  if st == 'done' then return 'done' end
  if st == 'failed' and waited then return 'failed' end
  if st == 'pending' then
    local lock = redis.call('HMGET', ekey, 'rbo:' .. token, 'rbx:' .. token)
    if lock[1] and lock[1] ~= owner and (tonumber(lock[2] or '') or 0) > now then
      return 'wait'
    end
  end
  if final == '1' then
    if not is_owner then return 'fenced' end
    redis.call('HSET', ekey, 'rbp', token, 'exc', exc, 'hb', now + hb_ms)
  end
  redis.call('HSET', ekey, field, 'pending', 'rbo:' .. token, owner, 'rbx:' .. token, now + hb_ms)
  return 'go'
elseif op == 'rb_touch' then
  local token = ARGV[4]
  local v = redis.call('HMGET', ekey, 'rb:' .. token, 'rbo:' .. token)
  if v[1] ~= 'pending' or v[2] ~= owner then return 0 end
  redis.call('HSET', ekey, 'rbx:' .. token, now + hb_ms)
  return 1
elseif op == 'rb_end' then
  local token, final, status = ARGV[4], ARGV[5], ARGV[6]
  redis.call('HSET', ekey, 'rb:' .. token, status)
  if status == 'done' or redis.call('HGET', ekey, 'rbo:' .. token) == owner then
    redis.call('HSET', ekey, 'rbx:' .. token, 0)  -- released (HSET: the documented ACL has no HDEL)
  end
  if final == '1' then redis.call('HSET', ekey, 'fin', status) end
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
