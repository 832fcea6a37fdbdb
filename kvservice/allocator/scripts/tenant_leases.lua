--- tenant_leases: a tenant's live leases, kept while it has a lease quota: a lease is
--- admitted under the quota (op 'admit'), raised to its new deadline by a keep-alive
--- ('touch'), or dropped when revoked ('drop'); leases past their deadline leave the set
--- by themselves.
---
--- KEYS[1]: the tenant's leases (zset lease id -> deadline, ms).
--- ARGV[1]: msgpack map {op, lease_id, left_ms (for 'touch': the lease's time left after the keep-alive:
---   its deadline is this shard's clock + left_ms),
---   ttl_ms and limit (for 'admit': the lease's TTL and the quota)}
--- Returns msgpack {leases (the tenant's live leases after the call)}; or an error
---   (lib/codec): RESOURCE_EXHAUSTED {reason QUOTA_EXCEEDED, quota 'leases', limit} when
---   the tenant holds its quota of live leases already (a retried grant of a lease it
---   holds is admitted).
--- @include "lib/time"
--- @include "lib/codec"

local K = KEYS[1]
local p = args()
local _, res = guarded(function()
  local now = now_ms()
  redis.call('ZREMRANGEBYSCORE', K, '-inf', now)
  if p.op == 'drop' then
    redis.call('ZREM', K, p.lease_id)
  elseif p.op == 'touch' then
    redis.call('ZADD', K, 'GT', now + p.left_ms, p.lease_id)
  else
    if not redis.call('ZSCORE', K, p.lease_id) then
      local n = redis.call('ZCARD', K)
      if n >= p.limit then
        bad('RESOURCE_EXHAUSTED', 'the tenant holds ' .. n .. ' live leases: its quota of leases is ' .. p.limit,
          {reason = 'QUOTA_EXCEEDED', quota = 'leases', limit = p.limit, needed = 1, available = 0})
      end
    end
    redis.call('ZADD', K, 'GT', now + p.ttl_ms, p.lease_id)
  end
  -- (the set goes a second after its last lease's deadline)
  local last = redis.call('ZRANGE', K, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIRE', K, math.max(1, tonumber(last[2]) - now) + 1000) end
  return reply({leases = redis.call('ZCARD', K)})
end)
return res
