--- lease_keepalive: extends a live lease by its TTL (the caller then touches the lease in
--- each of its pools: lease_touch).
---
--- KEYS[1]: the lease hash; KEYS[2]: the lease's pools set.
--- ARGV[1]: msgpack map {lease_id, tombstone_ms}
--- Returns msgpack {lease_id, tenant, ttl_ms, deadline_ms (this shard's clock), pools}; or an error (lib/codec):
---   NOT_FOUND, FAILED_PRECONDITION (reason LEASE_EXPIRED).
--- @include "lib/time"
--- @include "lib/lease"

local p = args()
local now = now_ms()
local _, res = guarded(function()
  local l = live_lease(p.lease_id, now)
  local deadline = now + l.ttl_ms
  redis.call('HSET', K_LEASE, 'deadline', deadline)
  redis.call('PEXPIRE', K_LEASE, l.ttl_ms + p.tombstone_ms)
  redis.call('PEXPIRE', K_LEASE_POOLS, l.ttl_ms + p.tombstone_ms)
  return reply({lease_id = p.lease_id, tenant = l.tenant, ttl_ms = l.ttl_ms, deadline_ms = deadline,
                pools = redis.call('SMEMBERS', K_LEASE_POOLS)})
end)
return res
