-- Shared prelude, prepended to every script.

-- bad_counter(counter_key): why the token counter cannot be used (someone else wrote it), or
-- nil. Checked before a script writes anything, so a refused script leaves no partial writes.
-- Errors raised as 'CRAWLDATA ...' reach callers as StoreDataError.
-- The second value returned is the counter as read (0 when missing), for issue_token.
local function bad_counter(counter_key)
  local v = redis.pcall('GET', counter_key)
  if type(v) == 'table' and v.err then
    return 'CRAWLDATA token counter ' .. counter_key .. ' is not a string'
  end
  if v and (not string.match(v, '^%d+$') or #v > 18) then
    return 'CRAWLDATA token counter ' .. counter_key .. ' does not hold a token'
  end
  return nil, tonumber(v or '0')
end

-- next_token(counter_key): the namespace's single fencing-token source: max(INCR, TIME in us).
-- The server clock bounds every token issued before from below as long as fewer than one token
-- per microsecond was issued, so a counter that went back (missing after a restart without
-- persistence, older after a restart from an older RDB snapshot or a failover to a lagging
-- replica) still never issues a token at or below one already issued. The counter is set to the
-- token issued, so "token t was issued => t <= GET counter" holds for the audited backend.
local function next_token(counter_key)
  local n = redis.call('INCR', counter_key)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if now > n then
    redis.call('SET', counter_key, string.format('%d', now))
    return now
  end
  return n
end

-- issue_token(counter_key, counter): next_token for a script that read the counter itself
-- (bad_counter's second value) and keeps it in counter.last: the same token (max(counter + 1,
-- TIME in us)) and the same counter afterwards, in two calls instead of three.
local function issue_token(counter_key, counter)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local n = counter.last + 1
  if now > n then n = now end
  redis.call('SET', counter_key, string.format('%d', n))
  counter.last = n
  return n
end

-- lease_is(lease_key, holder, token): the lease key exists and names this holder (and token,
-- when token is not the empty string).
local function lease_is(lease_key, holder, token)
  local v = redis.call('HMGET', lease_key, 'holder', 'token')
  if not v[1] or v[1] ~= holder then return false end
  if token ~= '' and v[2] ~= token then return false end
  return true
end

-- fence_refused(lease_key, holder, token, first): whether a fenced write under (holder, token)
-- to the records KEYS[first..] is refused: nil when it may go on, else -1 (lease not current),
-- -2 (a record written under a newer token) or -3 (a writer token that is not a number:
-- foreign data). Every record is checked before any is written.
local function fence_refused(lease_key, holder, token, first)
  if not lease_is(lease_key, holder, token) then return -1 end
  for i = first, #KEYS do
    local t = redis.call('HGET', KEYS[i], 't')
    if t then
      local tn = tonumber(t)
      if not tn then return -3 end
      if tn > tonumber(token) then return -2 end
    end
  end
  return nil
end

-- hmget_safe(key, fields...): HMGET, or nil when the key is not a hash (foreign data must not
-- abort a script that serves other keys, e.g. the reaper's scan).
local function hmget_safe(key, ...)
  local r = redis.pcall('HMGET', key, ...)
  if type(r) == 'table' and r.err then return nil end
  return r
end

-- lease_alive(lease_key, holder, ltoken): the claim's lease key exists with the claim's
-- holder and lease token. A claim missing any of them is not alive.
local function lease_alive(lease_key, holder, ltoken)
  if not lease_key or not holder or not ltoken then return false end
  local cur = hmget_safe(lease_key, 'holder', 'token')
  return cur ~= nil and cur[1] ~= false and cur[1] == holder and cur[2] == ltoken
end

-- declared_keys(from): the set of KEYS[from..]. Every key a script touches is declared (Redis
-- Cluster routes by them); a key named by stored data is looked up here, and a script that
-- meets one that was not passed reports it instead of touching it.
local function declared_keys(from)
  local set = {}
  for i = from, #KEYS do set[KEYS[i]] = true end
  return set
end

-- claim_row(out, ck, c, alive): append one claim to a flat reply (missing fields as '').
local function claim_row(out, ck, c, alive)
  out[#out + 1] = ck
  out[#out + 1] = c[1] or ''
  out[#out + 1] = c[2] or ''
  out[#out + 1] = c[3] or ''
  out[#out + 1] = c[4] or ''
  out[#out + 1] = alive
end
