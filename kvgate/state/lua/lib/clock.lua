-- Redis's own clock, in ms: every instance's scripts agree on it whatever their hosts' clocks.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

