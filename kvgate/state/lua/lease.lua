-- Leases of one pool, in one atomic step (see kvgate/state/base.py for the contract).
--   KEYS[1]  sorted set: lease id -> expiry (ms, Redis server time)
--   KEYS[2]  hash: lease id -> amount
--   KEYS[3]  string: the sum of the live amounts
--   ARGV[1]  op: acquire | release | renew | held
-- The three keys share a hash tag, so the script stays in one Redis Cluster slot.
local expiries, amounts, total = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

-- Expired leases no longer count: drop them, and their units return to the pool.
local expired = redis.call('ZRANGEBYSCORE', expiries, '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, id in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', amounts, id) or 0)
    redis.call('HDEL', amounts, id)
  end
  redis.call('ZREMRANGEBYSCORE', expiries, '-inf', now)
  redis.call('DECRBY', total, freed)
end
local held = math.max(0, tonumber(redis.call('GET', total) or 0))

-- The keys live as long as the longest lease, so an abandoned pool disappears by itself.
local function settle()
  local last = redis.call('ZRANGE', expiries, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', expiries, amounts, total)
    return
  end
  local ttl = math.ceil(tonumber(last[2]) - now) + 1000
  for _, key in ipairs(KEYS) do
    redis.call('PEXPIRE', key, ttl)
  end
end

if op == 'acquire' then
  -- ARGV: op, lease id, amount, limit, ttl (ms)
  local id, amount, limit, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local current = tonumber(redis.call('HGET', amounts, id) or 0)
  if held - current + amount > limit then
    if #expired > 0 then settle() end
    return 0
  end
  redis.call('ZADD', expiries, string.format('%.17g', now + ttl), id)
  redis.call('HSET', amounts, id, amount)
  redis.call('INCRBY', total, amount - current)
  settle()
  return 1
elseif op == 'release' then
  -- ARGV: op, lease id[, channel, pool]
  local id = ARGV[2]
  local amount = redis.call('HGET', amounts, id)
  if not amount then
    if #expired > 0 then settle() end
    return 0
  end
  redis.call('ZREM', expiries, id)
  redis.call('HDEL', amounts, id)
  redis.call('DECRBY', total, amount)
  settle()
  -- ARGV[3], ARGV[4]: a channel and the pool's name, to tell waiting instances at once
  if ARGV[3] then
    redis.call('PUBLISH', ARGV[3], ARGV[4])
  end
  return tonumber(amount)
elseif op == 'renew' then
  -- ARGV: op, ttl (ms), lease id...
  local expiry = string.format('%.17g', now + tonumber(ARGV[2]))
  local live = 0
  for i = 3, #ARGV do
    if redis.call('ZSCORE', expiries, ARGV[i]) then
      redis.call('ZADD', expiries, 'XX', expiry, ARGV[i])
      live = live + 1
    end
  end
  settle()
  return live
elseif op == 'held' then
  if #expired > 0 then settle() end
  return held
end
return redis.error_reply('lease.lua: unknown op ' .. tostring(op))
