--- lease_attach: checks that a lease is live and records the pools where it will hold
--- sequences (pools may be empty: a check that writes nothing).
---
--- KEYS[1]: the lease hash; KEYS[2]: the lease's pools set.
--- ARGV[1]: msgpack map {lease_id, pools = [pool id], tombstone_ms}
--- Returns msgpack {tenant, deadline_ms, left_ms (its time left, for the pools' shards)}; or an error (lib/codec): NOT_FOUND,
---   FAILED_PRECONDITION (reason LEASE_EXPIRED).
--- @include "lib/time"
--- @include "lib/lease"

local p = args()
local now = now_ms()
local _, res = guarded(function()
  local l = live_lease(p.lease_id, now)
  if #p.pools > 0 then
    redis.call('SADD', K_LEASE_POOLS, unpack(p.pools))
    redis.call('PEXPIRE', K_LEASE_POOLS, (l.deadline_ms - now) + p.tombstone_ms)
  end
  return reply({tenant = l.tenant, deadline_ms = l.deadline_ms, left_ms = l.deadline_ms - now})
end)
return res
