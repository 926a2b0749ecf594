-- Decide whether a run of an idempotency key may start, atomically taking the key when it may.
--
-- KEYS: 1 the key's record (hash), 2 the fence record of this task, 3 the fence record of the
--       task the key's record belongs to, as far as the caller knows (by default this task's)
-- ARGV: 1 task id, 2 claim token ('' = none), 3 run id (unique per run), 4 heartbeat TTL (ms),
--       5 record expiry (s, 0 = none), 6 prefix of fence records (+ task id),
--       7 force ('1': treat a live owner as dead; for a poisoned task the worker gave up on)
-- Record fields: task, token, owner, hb (server ms until which the owner counts as alive),
--   rbp (token whose final-failure rollback is pending), exc (that failure, JSON),
--   fin (outcome of that rollback: done | failed), rb:<token> (pending | done | failed),
--   owed (claim tokens of dead runs whose takeover rollback is not done yet, each + ';').
-- Returns {decision, task id of the record, extra[, token]}:
--   run            no live run: this run now owns the key; extra 'takeover' (with the claim
--                  tokens, ';'-separated, oldest first) when it takes the key from a run that
--                  stopped beating before it finished and whose effects were not rolled back
--   rollback       a final-failure rollback was left unfinished by a dead run: finish it (extra: exc)
--   finished       the owning task reached a ready state: replay it
--   finished-rb    the owning task failed and rolled back (extra: fin) but may not have stored it
--   duplicate      this same task id is running elsewhere
--   busy           another task holds this key and is alive
--   need           (extra: that task id) the record belongs to a task whose fence record was not
--                  passed as KEYS[3]; nothing was written, the caller passes it and asks again
--                  (every key a script touches is declared: Redis Cluster routes by them)
local ekey = KEYS[1]
local task, token, owner = ARGV[1], ARGV[2], ARGV[3]
local hb_ms, keep_s, fprefix = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local force = ARGV[7] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- A run that takes the key raises its task's fence floor to its claim token: a stale run of
-- the same task resumed after a freeze can then no longer store its (fenced) outcome in the
-- instant before this run's first state write (store.lua refuses an older token).
local function raise_floor()
  local n = tonumber(token)
  if not n then return end
  local fkey = KEYS[2]
  -- TTL first: a task's first run finds no fence record (-2) and needs no HGET.
  local ttl = redis.call('TTL', fkey)
  if ttl ~= -2 then
    local cur = tonumber(redis.call('HGET', fkey, 'token') or '')
    if cur and cur >= n then return end
  end
  redis.call('HSET', fkey, 'token', token)
  if keep_s > 0 and ttl < 0 then redis.call('EXPIRE', fkey, keep_s) end
end

local function take(decision, extra, xtoken)
  redis.call('HSET', ekey, 'task', task, 'token', token, 'owner', owner, 'hb', now + hb_ms)
  if keep_s > 0 then redis.call('EXPIRE', ekey, keep_s) end
  raise_floor()
  return {decision, task, extra, xtoken or ''}
end

local e = redis.call('HMGET', ekey, 'task', 'token', 'owner', 'hb', 'rbp', 'exc', 'fin')
if not e[1] then return take('run', '') end
local etask, etoken, ehb = e[1], e[2] or '', tonumber(e[4] or '0')
local rbp, exc, fin = e[5], e[6] or '', e[7]
local efence = nil
if fprefix .. etask == KEYS[2] then efence = KEYS[2]
elseif fprefix .. etask == KEYS[3] then efence = KEYS[3]
else return {'need', etask, ''} end

if fin then
  if redis.call('HGET', efence, 'ready') == '1' then return {'finished', etask, fin} end
  return {'finished-rb', etask, fin, exc}
end
if redis.call('HGET', efence, 'ready') == '1' and not rbp then
  return {'finished', etask, ''}
end

local alive = ehb > now and not force
-- A newer claim token for the same task id is only issued once the older claim is dead.
local ntoken, etok = tonumber(token), tonumber(etoken)
local newer = task == etask and ntoken ~= nil and etok ~= nil and ntoken > etok
if not alive or newer then
  if rbp then
    -- Finish the dead run's rollback under its own token; the record stays that task's.
    redis.call('HSET', ekey, 'token', token, 'owner', owner, 'hb', now + hb_ms)
    if task == etask then raise_floor() end
    return {'rollback', etask, exc, rbp}
  end
  -- The dead run may have left effects (killed after a write, before its result): the run
  -- taking over undoes them first, once per token, or they would stick twice. Tokens still
  -- owed a rollback (a taking-over run that died before finishing it) stay on the list.
  local owed, seen, out = {}, {}, {}
  for tok in string.gmatch((redis.call('HGET', ekey, 'owed') or '') .. etoken .. ';', '([^;]*);') do
    if not seen[tok] and redis.call('HGET', ekey, 'rb:' .. tok) ~= 'done' then
      seen[tok] = true
      owed[#owed + 1] = tok
      out[#out + 1] = tok .. ';'
    end
  end
  redis.call('HSET', ekey, 'owed', table.concat(out))
  if #owed > 0 then return take('run', 'takeover', table.concat(owed, ';')) end
  return take('run', '')
end
if task == etask then return {'duplicate', etask, ''} end
return {'busy', etask, ''}
