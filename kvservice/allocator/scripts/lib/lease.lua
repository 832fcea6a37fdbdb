--- @include "lib/codec"
--- The keys of one lease (KEYS[1]: its hash, KEYS[2]: the set of pools where it holds
--- sequences) and the check that it is live.
local K_LEASE, K_LEASE_POOLS = KEYS[1], KEYS[2]

-- The lease's {tenant, ttl_ms, deadline_ms}; raises NOT_FOUND, or FAILED_PRECONDITION
-- (reason LEASE_EXPIRED) for a revoked or expired lease.
local function live_lease(lease_id, now)
  local l = redis.call('HMGET', K_LEASE, 'tenant', 'ttl_ms', 'deadline', 'revoked')
  if not l[1] then bad('NOT_FOUND', 'lease ' .. lease_id .. ' not found') end
  if l[4] == '1' then bad('FAILED_PRECONDITION', 'lease ' .. lease_id .. ' was revoked', {reason = 'LEASE_EXPIRED'}) end
  if tonumber(l[3]) <= now then
    bad('FAILED_PRECONDITION', 'lease ' .. lease_id .. ' has expired', {reason = 'LEASE_EXPIRED'})
  end
  return {tenant = l[1], ttl_ms = tonumber(l[2]), deadline_ms = tonumber(l[3])}
end
