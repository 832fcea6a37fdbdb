--- lease_touch: the pool side of a keep-alive; raises the lease's deadline in the pool
--- where the pool knows the lease.
---
--- KEYS[1]: the pool's leases zset.
--- ARGV[1]: msgpack map {lease_id, deadline_ms}
--- Returns msgpack {touched (whether the pool knew the lease)}.
--- @include "lib/codec"

local K_LEASES = KEYS[1]
local p = args()
if redis.call('ZSCORE', K_LEASES, p.lease_id) then
  redis.call('ZADD', K_LEASES, 'GT', p.deadline_ms, p.lease_id)
  return reply({touched = true})
end
return reply({touched = false})
