-- Token buckets (see kvgate/state/base.py for the contract), as functions: redis.py's
-- _Script puts this file before every script that uses it, so the logic lives here once.
-- Mirrors kvgate/state/memory.py's _Bucket.
-- A bucket is one hash: level (units, may be negative: debt) and ts (ms, Redis server time).
-- Refill is continuous at capacity/period. A missing key is a full bucket, so the key expires
-- when the bucket would be full again.

-- Opens a bucket: its level as of `now`.
local function bucket_open(key, capacity, period_s, now)
  local bucket = {key = key, capacity = capacity, rate = capacity / (period_s * 1000), now = now}
  bucket.level = capacity
  local state = redis.call('HMGET', key, 'level', 'ts')
  if state[1] then
    local elapsed = math.max(0, now - tonumber(state[2]))
    bucket.level = math.min(capacity, tonumber(state[1]) + elapsed * bucket.rate)
  end
  return bucket
end

-- Milliseconds until `amount` would fit. More than the whole capacity never fits: then the
-- time to a full bucket.
local function bucket_wait(bucket, amount)
  return math.max(0, (math.min(amount, bucket.capacity) - bucket.level) / bucket.rate)
end

-- A refund (delta > 0, capped at the capacity) or an overdraw taken by force (delta < 0).
local function bucket_correct(bucket, delta)
  bucket.level = math.min(bucket.capacity, bucket.level + delta)
end

-- Writes the level back (a full bucket is no key at all).
local function bucket_save(bucket)
  if bucket.level >= bucket.capacity then
    redis.call('DEL', bucket.key)
    return
  end
  local reset = (bucket.capacity - bucket.level) / bucket.rate
  redis.call('HSET', bucket.key, 'level', string.format('%.17g', bucket.level),
             'ts', string.format('%.17g', bucket.now))
  redis.call('PEXPIRE', bucket.key, math.ceil(reset) + 1000)
end

-- The reply kvgate/state/redis.py reads: allowed (1 | 0), level, retry_after_ms, reset_ms;
-- numbers as strings (an integer reply would truncate them). Appended to `reply`.
local function bucket_reply(reply, bucket, allowed, retry)
  local reset = (bucket.capacity - bucket.level) / bucket.rate
  reply[#reply + 1] = allowed
  reply[#reply + 1] = string.format('%.17g', bucket.level)
  reply[#reply + 1] = string.format('%.17g', retry)
  reply[#reply + 1] = string.format('%.17g', reset)
  return reply
end

