--- The scripts' side of the codec (kvservice/allocator/codec.py is the other side):
--- arguments arrive as one msgpack map in ARGV[1]; every reply is one msgpack map.
--- An error reply is {error = <gRPC code name>, message = ..., reason = <ErrorInfo
--- reason>?, ...}; bad() raises one from anywhere, guarded() turns it into the reply.

local function args()
  return cmsgpack.unpack(ARGV[1])
end

local function reply(t)
  return cmsgpack.pack(t)
end

-- Raises a domain error (a table, so that it is told apart from a Lua runtime error).
local function bad(code, message, extra)
  error({code = code, message = message, extra = extra}, 0)
end

local function error_reply(e)
  local t = e.extra or {}
  t.error = e.code
  t.message = e.message
  return cmsgpack.pack(t)
end

-- A runtime error (not bad()'s) as text. Lua's own errors carry their line
-- ("user_script:<n>: ..."), which the store maps to the file; an error of redis.call
-- carries none (scripts have no debug library to find it).
local function runtime(e)
  if type(e) == 'table' and e.code then return e end
  return {runtime = type(e) == 'table' and tostring(e.err or e) or tostring(e)}
end

-- Runs fn(); a domain error becomes its error reply, a runtime error propagates.
-- Returns ok, result (result: fn's value, or the error reply).
local function guarded(fn)
  local ok, res = xpcall(fn, runtime)
  if ok then return true, res end
  if res.code then return false, error_reply(res) end
  error(res.runtime, 0)
end
