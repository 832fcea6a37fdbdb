--- lease_grant: grants a lease (the lease id is derived from the tenant and the request
--- id, so a retried grant finds the lease it made).
---
--- KEYS[1]: the lease hash; KEYS[2]: the lease's pools set.
--- ARGV[1]: msgpack map {lease_id, tenant, ttl_ms, fingerprint, request_id, tombstone_ms}
--- Returns msgpack {lease_id, tenant, ttl_ms, deadline_ms, replay}; replay is true for a
---   retried grant (same fingerprint), which returns the lease as it is now; or an error
---   (lib/codec): INVALID_ARGUMENT (a used request_id with other arguments).
--- @include "lib/time"
--- @include "lib/lease"

local p = args()
local now = now_ms()
local have = redis.call('HMGET', K_LEASE, 'fingerprint', 'tenant', 'ttl_ms', 'deadline')
if have[1] then
  if have[1] ~= p.fingerprint then
    return error_reply({code = 'INVALID_ARGUMENT',
      message = 'request_id ' .. p.request_id .. ' was already used with different arguments'})
  end
  return reply({lease_id = p.lease_id, tenant = have[2], ttl_ms = tonumber(have[3]),
                deadline_ms = tonumber(have[4]), replay = true})
end
local deadline = now + p.ttl_ms
redis.call('HSET', K_LEASE, 'tenant', p.tenant, 'ttl_ms', p.ttl_ms, 'deadline', deadline,
  'revoked', 0, 'fingerprint', p.fingerprint)
redis.call('PEXPIRE', K_LEASE, p.ttl_ms + p.tombstone_ms)
return reply({lease_id = p.lease_id, tenant = p.tenant, ttl_ms = p.ttl_ms, deadline_ms = deadline, replay = false})
