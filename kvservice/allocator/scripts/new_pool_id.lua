--- new_pool_id: a fresh pool id "pool-<n>" for a registration that names none; a retry
--- of the registration (same request id) gets the same id again.
---
--- KEYS[1]: the pool-id counter; KEYS[2]: the request's pool-id key (kvs:pools:req:<id>).
--- ARGV[1]: msgpack map {request_id ('': no retries to recognise), ttl_ms}
--- Returns msgpack {pool}.
--- @include "lib/codec"

local K_COUNTER, K_REQUEST = KEYS[1], KEYS[2]
local p = args()
if p.request_id ~= '' then
  local prev = redis.call('GET', K_REQUEST)
  if prev then return reply({pool = prev}) end
end
local pool = 'pool-' .. redis.call('INCR', K_COUNTER)
if p.request_id ~= '' then redis.call('SET', K_REQUEST, pool, 'PX', p.ttl_ms) end
return reply({pool = pool})
