--- lease_touch: the pool side of a keep-alive; raises the lease's deadline in the pool
--- where the pool knows the lease, to this shard's clock + the time the keep-alive gave it
--- (the lease's record may live on another shard, whose clock is not this one's).
---
--- KEYS[1]: the pool's leases zset.
--- ARGV[1]: msgpack map {lease_id, left_ms}
--- Returns msgpack {touched (whether the pool knew the lease)}.
--- @include "lib/time"
--- @include "lib/codec"

local K_LEASES = KEYS[1]
local p = args()
if redis.call('ZSCORE', K_LEASES, p.lease_id) then
  redis.call('ZADD', K_LEASES, 'GT', now_ms() + p.left_ms, p.lease_id)
  return reply({touched = true})
end
return reply({touched = false})
