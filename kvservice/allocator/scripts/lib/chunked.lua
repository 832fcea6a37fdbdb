--- Long argument lists in chunks (Lua's C stack takes a few thousand values), and block
--- ids as decimal strings made once per call (Redis would format each number argument
--- itself, slowly).
local CHUNK = 4000

local D = {}
local function dec(n)
  local s = string.format('%d', n)
  D[n] = s
  return s
end

-- Calls a variadic command over args in chunks; step keeps field/value pairs together.
local function call_chunked(cmd, key, args, step)
  step = step or 1
  local n = #args
  local per = CHUNK - (CHUNK % step)
  local i = 1
  while i <= n do
    local j = math.min(i + per - 1, n)
    redis.call(cmd, key, unpack(args, i, j))
    i = j + 1
  end
end

local function hmget_chunked(key, fields)
  local n = #fields
  if n > 0 and n <= CHUNK then return redis.call('HMGET', key, unpack(fields)) end
  local out = {}
  local i = 1
  while i <= n do
    local j = math.min(i + CHUNK - 1, n)
    local got = redis.call('HMGET', key, unpack(fields, i, j))
    for k = 1, #got do out[i + k - 1] = got[k] end
    i = j + 1
  end
  return out
end
