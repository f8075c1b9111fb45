-- A charge, all or nothing, in one atomic step (see StateStore.charge in
-- kvgate/state/base.py; the functions are in lib/leases.lua and lib/buckets.lua).
--   KEYS   with a lease, its pool's three keys; then one key per bucket (one hash tag for all)
--   ARGV   '1' and the lease's id, amount, limit, ttl (ms) — or '0' with no lease; then per
--          bucket: amount, capacity, period (s)
-- The lease and every take are checked first and held only if all fit; a refusal changes
-- nothing. Returns {lease fits (1 | 0), then per bucket: allowed, level, retry_ms, reset_ms}.
local now = now_ms()
local granted, lease_fits = true, 1
local pool, id, amount, ttl
local first_key, first_arg = 1, 2
if ARGV[1] == '1' then
  pool = pool_open(KEYS[1], KEYS[2], KEYS[3], now)
  id, amount, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
  if not pool_fits(pool, id, amount, tonumber(ARGV[4])) then
    granted, lease_fits = false, 0
  end
  first_key, first_arg = 4, 6
end

local buckets, amounts = {}, {}
for i = first_key, #KEYS do
  local a = first_arg + 3 * (i - first_key)
  local bucket = bucket_open(KEYS[i], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), now)
  buckets[#buckets + 1], amounts[#amounts + 1] = bucket, tonumber(ARGV[a])
  if amounts[#amounts] > bucket.level then
    granted = false
  end
end

local reply = {lease_fits}
if granted then
  if pool then
    pool_hold(pool, id, amount, ttl)
  end
  for i, bucket in ipairs(buckets) do
    bucket.level = bucket.level - amounts[i]
    bucket_save(bucket)
    bucket_reply(reply, bucket, 1, 0)
  end
else
  for i, bucket in ipairs(buckets) do
    if amounts[i] <= bucket.level then
      bucket_reply(reply, bucket, 1, 0)
    else
      bucket_reply(reply, bucket, 0, bucket_wait(bucket, amounts[i]))
    end
  end
end
if pool then
  pool_close(pool) -- expired leases may have gone even on a refusal
end
return reply
