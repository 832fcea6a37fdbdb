--- The Redis clock (TIME) in milliseconds: the only clock the allocator uses.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
