--- @include "lib/codec"
--- Idempotency: a mutating call's outcome is kept under its request key (the last KEY the
--- script takes) for request_ttl_ms, prefixed by the fingerprint of the whole request
--- (64 hex digits), so that a retry returns the first outcome and a different request
--- under a used id is refused.
local FINGERPRINT_LEN = 64

-- Returns the stored reply of the request, or nil when it has none.
local function replay(key, p)
  if p.request_id == '' then return nil end
  local prev = redis.call('GET', key)
  if not prev then return nil end
  if string.sub(prev, 1, FINGERPRINT_LEN) ~= p.fingerprint then
    return error_reply({code = 'INVALID_ARGUMENT',
      message = 'request_id ' .. p.request_id .. ' was already used with different arguments'})
  end
  return string.sub(prev, FINGERPRINT_LEN + 1)
end

-- Stores the reply (when the request has an id) and returns it.
local function remember(key, p, out)
  if p.request_id ~= '' then
    redis.call('SET', key, p.fingerprint .. out, 'PX', p.request_ttl_ms)
  end
  return out
end
