--- lease_revoke: marks a lease revoked (idempotent); the caller then reaps its pools.
---
--- KEYS[1]: the lease hash; KEYS[2]: the lease's pools set.
--- ARGV[1]: msgpack map {lease_id}
--- Returns msgpack {pools (where the lease holds sequences)}; or an error (lib/codec): NOT_FOUND.
--- @include "lib/lease"

local p = args()
if redis.call('EXISTS', K_LEASE) == 0 then
  return error_reply({code = 'NOT_FOUND', message = 'lease ' .. p.lease_id .. ' not found'})
end
redis.call('HSET', K_LEASE, 'revoked', 1, 'deadline', 0)
return reply({pools = redis.call('SMEMBERS', K_LEASE_POOLS)})
