--- place: remembers where a request's creates without a pool were placed, so that a retry
--- of the request (same request id, same fingerprint) lands in the same pools and gets
--- the first outcome from them, instead of being placed again.
---
--- KEYS[1]: the placement key of (lease, request id).
--- ARGV[1]: msgpack map {request_id, fingerprint, pools = [pool id per create], ttl_ms}
--- Returns msgpack {pools}: the first placement of the request (this one if it is the
---   first); or an error (lib/codec): INVALID_ARGUMENT (a used request_id with other
---   arguments).
--- @include "lib/codec"

local K_PLACE = KEYS[1]
local p = args()
local prev = redis.call('GET', K_PLACE)
if prev then
  local first = cmsgpack.unpack(prev)
  if first.fingerprint ~= p.fingerprint then
    return error_reply({code = 'INVALID_ARGUMENT',
      message = 'request_id ' .. p.request_id .. ' was already used with different arguments'})
  end
  return reply({pools = first.pools})
end
redis.call('SET', K_PLACE, cmsgpack.pack({fingerprint = p.fingerprint, pools = p.pools}), 'PX', p.ttl_ms)
return reply({pools = p.pools})
