-- One state write of the audited result backend: precedence, fencing, SET with expiry, PUBLISH
-- and the audit XADD, in one round trip.
--
-- KEYS: 1 result key, 2 fence record (hash), 3 audit stream, 4 (optional) the record of the
--       idempotency key the run owned (idem_begin.lua)
-- ARGV: 1 encoded meta, 2 state, 3 ready ('1' | '0'), 4 claim token ('' = none), 5 digest,
--       6 expiry seconds (0 = none), 7 stream MAXLEN (approximate), 8 worker, 9 rollback outcome,
--       10 check token issuance ('1' | '0'), 11 task id, 12 the lease store's token counter as
--       the caller read it (a GET before this script when the token is above every value it
--       read before; '0' = never read or missing), 13 (with KEYS[4]) the run id that must still
--       own the idempotency key: the SUCCESS of an IdempotentTask run that published nothing
--       after its body (no callbacks, no chain) is written only if no newer run took its key
--       over meanwhile; otherwise 'refused-fenced' (the run then rolls back and fails),
--       14 '1' for an operator's revoke (an untokened REVOKED from outside any run): it may
--       replace a tokened state while no run is going (PENDING, RECEIVED, RETRY, REJECTED) and
--       keeps that state's token, so the run that wrote it cannot overwrite the revoke
-- The counter is read by the caller, not here: every key a script touches must be declared
-- (Redis Cluster routes by them), and Redis's ACL treats every declared key as read-write,
-- while the backend's user should only read the counter, so that it cannot forge it (%R~ in
-- docs/security.md). The counter only grows, so a value read before this write bounds the
-- tokens issued so far from below: a token above it was not issued when it was read.
-- Returns {outcome, replayed (1 when this exact attempt was answered before)}.
local rkey, fkey, skey, counter = KEYS[1], KEYS[2], KEYS[3], ARGV[12]
local value, state, ready, token, digest = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local expires, maxlen = tonumber(ARGV[6]), ARGV[7]
local worker, rollback, check, task = ARGV[8], ARGV[9], ARGV[10], ARGV[11]

local function audit(outcome)
  redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', 'task', task, 'state', state,
             'token', token, 'worker', worker, 'digest', digest, 'outcome', outcome,
             'rollback', rollback)
end

-- A run that lost its idempotency key is refused before anything else: its write may equal the
-- newer run's to the digest (a replay must not answer it), and it leaves the fence record alone
-- (the newer run's retried write still gets its own first answer).
if KEYS[4] and redis.call('HGET', KEYS[4], 'owner') ~= ARGV[13] then
  audit('refused-fenced')
  return {'refused-fenced', 0}
end

-- A retried write (celery's ensure() after a lost reply) gets the first answer, and no second
-- audit record.
local attempt = token .. '|' .. state .. '|' .. digest
local cur = redis.call('HMGET', fkey, 'token', 'state', 'ready', 'last', 'outcome')
if cur[4] == attempt then
  return {cur[5], 1}
end

local ntoken = nil
if token ~= '' then ntoken = tonumber(token) end

local cur_token, cur_ready = cur[1], cur[3]
-- A token without a state is the floor an IdempotentTask run raised when it began
-- (idem_begin.lua): an older claim token is refused; a write without a token is judged as
-- before (nothing was stored yet).
local floor = nil
if not cur[2] then
  -- No state stored through this backend yet, or a result written by a stock backend.
  floor = cur_token and tonumber(cur_token)
  cur_token = false
  cur_ready = '0'
  -- Whether a stock result is ready decides only a non-ready or an untokened write (below):
  -- a tokened ready write, every task's usual first write, does not read it.
  if ready ~= '1' or not ntoken then
    local old = redis.call('GET', rkey)
    if old then
      local ok, meta = pcall(cjson.decode, old)
      if ok and type(meta) == 'table' then
        local s = meta['status']
        if s == 'SUCCESS' or s == 'FAILURE' or s == 'REVOKED' then cur_ready = '1' end
      end
    end
  end
end

local ctoken = nil
if cur_token and cur_token ~= '' then ctoken = tonumber(cur_token) end

local outcome = 'written'
if check == '1' and ntoken then
  local issued = tonumber(counter)
  if not issued or ntoken > issued then outcome = 'refused-unissued' end
end
if outcome == 'written' then
  if floor and ntoken and ntoken < floor then
    outcome = 'refused-stale'
  elseif ctoken and not ntoken and ARGV[14] == '1' and cur_ready ~= '1'
      and (cur[2] == 'PENDING' or cur[2] == 'RECEIVED' or cur[2] == 'RETRY'
           or cur[2] == 'REJECTED') then
    token = cur_token
  elseif ctoken and (not ntoken or ntoken < ctoken) then
    outcome = 'refused-stale'
  elseif cur_ready == '1' then
    if ready ~= '1' then
      outcome = 'refused-regression'
    elseif not ntoken or (ctoken and ntoken <= ctoken) then
      outcome = 'refused-stale'
    end
  end
end

if outcome == 'written' then
  if expires > 0 then
    redis.call('SET', rkey, value, 'EX', expires)
  else
    redis.call('SET', rkey, value)
  end
  redis.call('PUBLISH', rkey, value)
  redis.call('HSET', fkey, 'token', token, 'state', state, 'ready', ready, 'digest', digest,
             'last', attempt, 'outcome', outcome)
  if expires > 0 then redis.call('EXPIRE', fkey, expires) else redis.call('PERSIST', fkey) end
else
  redis.call('HSET', fkey, 'last', attempt, 'outcome', outcome)
  if expires > 0 and redis.call('TTL', fkey) == -1 then redis.call('EXPIRE', fkey, expires) end
end

audit(outcome)
return {outcome, 0}
