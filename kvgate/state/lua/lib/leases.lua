-- Leases of one pool (see kvgate/state/base.py for the contract), as functions: redis.py's
-- _Script puts this file before every script that uses it, so the logic lives here once.
-- A pool is three keys with one hash tag:
--   expiries  sorted set: lease id -> expiry (ms, Redis server time)
--   amounts   hash: lease id -> amount
--   total     string: the sum of the live amounts

-- Opens a pool as of `now`: expired leases no longer count, so they are dropped and their
-- units return to the pool.
local function pool_open(expiries, amounts, total, now)
  local pool = {expiries = expiries, amounts = amounts, total = total, now = now, changed = false}
  local expired = redis.call('ZRANGEBYSCORE', expiries, '-inf', now)
  if #expired > 0 then
    local freed = 0
    for _, id in ipairs(expired) do
      freed = freed + tonumber(redis.call('HGET', amounts, id) or 0)
      redis.call('HDEL', amounts, id)
    end
    redis.call('ZREMRANGEBYSCORE', expiries, '-inf', now)
    redis.call('DECRBY', total, freed)
    pool.changed = true
  end
  pool.held = math.max(0, tonumber(redis.call('GET', total) or 0))
  return pool
end

-- After a change, the keys live as long as the longest lease, so an abandoned pool
-- disappears by itself.
local function pool_close(pool)
  if not pool.changed then return end
  local last = redis.call('ZRANGE', pool.expiries, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', pool.expiries, pool.amounts, pool.total)
    return
  end
  local ttl = math.ceil(tonumber(last[2]) - pool.now) + 1000
  redis.call('PEXPIRE', pool.expiries, ttl)
  redis.call('PEXPIRE', pool.amounts, ttl)
  redis.call('PEXPIRE', pool.total, ttl)
end

-- Whether lease `id` may hold `amount` units (replacing what it holds now) within `limit`.
local function pool_fits(pool, id, amount, limit)
  local current = tonumber(redis.call('HGET', pool.amounts, id) or 0)
  return pool.held - current + amount <= limit
end

-- Holds `amount` units as lease `id` until now + ttl (ms), replacing what it held.
local function pool_hold(pool, id, amount, ttl)
  local current = tonumber(redis.call('HGET', pool.amounts, id) or 0)
  redis.call('ZADD', pool.expiries, string.format('%.17g', pool.now + ttl), id)
  redis.call('HSET', pool.amounts, id, amount)
  redis.call('INCRBY', pool.total, amount - current)
  pool.held = pool.held - current + amount
  pool.changed = true
end

-- Drops lease `id`; returns the units it held (0: already released or expired). With a
-- channel, announces the release (the pool's name) to every instance watching.
local function pool_release(pool, id, channel, name)
  local amount = redis.call('HGET', pool.amounts, id)
  if not amount then return 0 end
  redis.call('ZREM', pool.expiries, id)
  redis.call('HDEL', pool.amounts, id)
  redis.call('DECRBY', pool.total, amount)
  pool.held = pool.held - tonumber(amount)
  pool.changed = true
  if channel then
    redis.call('PUBLISH', channel, name)
  end
  return tonumber(amount)
end

