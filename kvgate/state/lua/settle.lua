-- A settlement in one atomic step (see StateStore.settle in kvgate/state/base.py; the
-- functions are in lib/leases.lua and lib/buckets.lua).
--   KEYS   with a lease to release, its pool's three keys; then one key per bucket (one hash
--          tag for all)
--   ARGV   '1' and the lease's id, the releases channel, the pool's name — or '0' with no
--          lease; then per bucket: delta (> 0 put back, < 0 taken by force), capacity, period (s)
-- Returns {units released, then per bucket: allowed, level, retry_ms, reset_ms}.
local now = now_ms()
local released = 0
local first_key, first_arg = 1, 2
if ARGV[1] == '1' then
  local pool = pool_open(KEYS[1], KEYS[2], KEYS[3], now)
  released = pool_release(pool, ARGV[2], ARGV[3], ARGV[4])
  pool_close(pool)
  first_key, first_arg = 4, 5
end

local reply = {released}
for i = first_key, #KEYS do
  local a = first_arg + 3 * (i - first_key)
  local bucket = bucket_open(KEYS[i], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), now)
  bucket_correct(bucket, tonumber(ARGV[a]))
  bucket_save(bucket)
  bucket_reply(reply, bucket, 1, 0)
end
return reply
