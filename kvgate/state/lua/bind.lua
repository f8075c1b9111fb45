-- Bind a key to a value, in one atomic step (see kvgate/state/base.py for the contract).
--   KEYS[1]  the binding
--   ARGV     value, ttl (ms), has_replace ('1' or '0'), replace
-- Sets the value (with a fresh TTL) when the key is unbound, already bound to the value, or
-- bound to `replace`; returns the value in force afterwards.
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] or (ARGV[3] == '1' and current == ARGV[4]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return current
