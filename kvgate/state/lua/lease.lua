-- Leases of one pool, in one atomic step (see kvgate/state/base.py for the contract; the
-- functions are in lib/leases.lua).
--   KEYS     the pool's sorted set, hash and total (one hash tag: one Redis Cluster slot)
--   ARGV[1]  op: acquire | release | renew | held
local pool = pool_open(KEYS[1], KEYS[2], KEYS[3], now_ms())
local op = ARGV[1]
local result
if op == 'acquire' then
  -- ARGV: op, lease id, amount, limit, ttl (ms)
  local id, amount = ARGV[2], tonumber(ARGV[3])
  result = 0
  if pool_fits(pool, id, amount, tonumber(ARGV[4])) then
    pool_hold(pool, id, amount, tonumber(ARGV[5]))
    result = 1
  end
elseif op == 'release' then
  -- ARGV: op, lease id[, channel, pool]: a channel and the pool's name, to tell waiting
  -- instances at once
  result = pool_release(pool, ARGV[2], ARGV[3], ARGV[4])
elseif op == 'renew' then
  -- ARGV: op, ttl (ms), lease id...
  local expiry = string.format('%.17g', pool.now + tonumber(ARGV[2]))
  result = 0
  for i = 3, #ARGV do
    if redis.call('ZSCORE', pool.expiries, ARGV[i]) then
      redis.call('ZADD', pool.expiries, 'XX', expiry, ARGV[i])
      result = result + 1
    end
  end
  pool.changed = true
elseif op == 'held' then
  result = pool.held
else
  return redis.error_reply('lease.lua: unknown op ' .. tostring(op))
end
pool_close(pool)
return result
