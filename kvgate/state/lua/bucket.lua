-- A token bucket, in one atomic step (see kvgate/state/base.py for the contract).
--   KEYS[1]  hash: level (units, may be negative: debt) and ts (ms, Redis server time)
--   ARGV     op (take | force | put_back | peek), amount, capacity, period (s)
-- Returns {allowed, level, retry_after_ms, reset_ms}, numbers as strings (an integer reply
-- would truncate them).
-- Refill is continuous at capacity/period. A missing key is a full bucket, so the key expires
-- when the bucket would be full again. Mirrors kvgate/state/memory.py's _Bucket.
local key, op = KEYS[1], ARGV[1]
local amount, capacity = tonumber(ARGV[2]), tonumber(ARGV[3])
local rate = capacity / (tonumber(ARGV[4]) * 1000) -- units per ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local level = capacity
local state = redis.call('HMGET', key, 'level', 'ts')
if state[1] then
  local elapsed = math.max(0, now - tonumber(state[2]))
  level = math.min(capacity, tonumber(state[1]) + elapsed * rate)
end

local allowed, retry = 1, 0
if op == 'take' then
  if amount <= level then
    level = level - amount
  else
    -- More than the whole capacity never fits: report the time to a full bucket.
    allowed = 0
    retry = (math.min(amount, capacity) - level) / rate
  end
elseif op == 'force' then
  level = level - amount
elseif op == 'put_back' then
  level = math.min(capacity, level + amount)
elseif op == 'peek' then
  if level < 1 then
    allowed = 0
    retry = (1 - level) / rate
  end
else
  return redis.error_reply('bucket.lua: unknown op ' .. tostring(op))
end

local reset = (capacity - level) / rate
if op ~= 'peek' then
  if level >= capacity then
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 'level', string.format('%.17g', level), 'ts', string.format('%.17g', now))
    redis.call('PEXPIRE', key, math.ceil(reset) + 1000)
  end
end
return {allowed, string.format('%.17g', level), string.format('%.17g', retry), string.format('%.17g', reset)}
