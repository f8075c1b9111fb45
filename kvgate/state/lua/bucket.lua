-- A token bucket, in one atomic step (see kvgate/state/base.py for the contract; the
-- functions are in lib/buckets.lua).
--   KEYS[1]  the bucket
--   ARGV     op (take | force | put_back | peek), amount, capacity, period (s)
-- Returns {allowed, level, retry_after_ms, reset_ms}.
local op, amount = ARGV[1], tonumber(ARGV[2])
local bucket = bucket_open(KEYS[1], tonumber(ARGV[3]), tonumber(ARGV[4]), now_ms())
local allowed, retry = 1, 0
if op == 'take' then
  if amount <= bucket.level then
    bucket.level = bucket.level - amount
  else
    allowed, retry = 0, bucket_wait(bucket, amount)
  end
elseif op == 'force' then
  bucket_correct(bucket, -amount)
elseif op == 'put_back' then
  bucket_correct(bucket, amount)
elseif op == 'peek' then
  if bucket.level < 1 then
    allowed, retry = 0, bucket_wait(bucket, 1)
  end
else
  return redis.error_reply('bucket.lua: unknown op ' .. tostring(op))
end
if op ~= 'peek' then
  bucket_save(bucket)
end
return bucket_reply({}, bucket, allowed, retry)
