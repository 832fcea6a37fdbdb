--- reserve: refills a lease's reserve of blocks in one pool (towards want, never above
--- the cap) and takes back the blocks the lease returns; the lease joins the pool's
--- leases (with its deadline) so that its reserve is reclaimed when it expires. New
--- blocks come from the free list, then never-used blocks, then LRU eviction.
---
--- KEYS[1..14]: the pool's keys (kvservice/allocator/keys.py); KEYS[15]: the request key.
--- ARGV[1]: msgpack map {pool, epoch, request_id ('': none), fingerprint, request_ttl_ms,
---   lease_id, lease_deadline_ms (0: attached to the pool already), want (the reserve
---   size asked for), cap (the most a lease may hold), pressure_blocks (below this many
---   free + evictable blocks the cap drops to pressure_cap), pressure_cap,
---   returned = [blocks the lease gives back]}
--- Returns msgpack {epoch, granted = [blocks added to the reserve], num_reserved (the
---   lease's reserve after the call), cap (the cap now: the lease returns any surplus)};
---   or an error (lib/codec): NOT_FOUND, FAILED_PRECONDITION (reasons EPOCH_CHANGED,
---   LEASE_EXPIRED), INVALID_ARGUMENT (a returned block that the lease does not hold),
---   and the internal LEASE_UNKNOWN.
--- @include "lib/time"
--- @include "lib/request"
--- @include "lib/refs"
--- @include "lib/reserve"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
local prev = replay(K_REQUEST, p)
if prev then return prev end
local lease = p.lease_id

local ok, plan = guarded(function()
  local epoch, num_blocks = pool_meta(p.pool)
  if p.epoch ~= epoch then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at epoch ' .. epoch .. ', not ' ..
      string.format('%d', p.epoch) .. ' (re-registered since)', {reason = 'EPOCH_CHANGED', epoch = epoch})
  end
  local now = now_ms()
  local deadline = tonumber(redis.call('ZSCORE', K_LEASES, lease))
  local attach = false
  if not (deadline and deadline > now) then
    if deadline or redis.call('ZSCORE', K_DEAD, lease) then
      bad('FAILED_PRECONDITION', 'lease ' .. lease .. ' has expired or was revoked; its blocks were freed',
        {reason = 'LEASE_EXPIRED'})
    end
    if p.lease_deadline_ms == 0 then bad('LEASE_UNKNOWN', 'lease ' .. lease .. ' is not attached to ' .. p.pool) end
    if not (p.lease_deadline_ms > now) then
      bad('FAILED_PRECONDITION', 'lease ' .. lease .. ' has expired', {reason = 'LEASE_EXPIRED'})
    end
    attach = true
  end
  local held = reserved_blocks(lease)
  local mine = {}
  for _, b in ipairs(held) do mine[b] = true end
  for _, b in ipairs(p.returned) do
    if not mine[b] then
      bad('INVALID_ARGUMENT', 'block ' .. string.format('%d', b) .. ' is not in the reserve of lease ' .. lease ..
        ' in pool ' .. p.pool)
    end
    mine[b] = nil
  end
  local available = available_now(num_blocks)
  local cap = p.cap
  if available < p.pressure_blocks then cap = math.min(cap, p.pressure_cap) end
  local kept = #held - #p.returned
  local need = math.max(0, math.min(p.want, cap) - kept)
  return {epoch = epoch, num_blocks = num_blocks, attach = attach, kept = kept, cap = cap,
          need = math.min(need, available)}
end)
if not ok then return plan end

if #p.returned > 0 then
  local members, fields = {}, {}
  for i, b in ipairs(p.returned) do members[i] = reserve_member(lease, b); fields[i] = D[b] or dec(b) end
  call_chunked('ZREM', K_RESERVE, members)
  call_chunked('RPUSH', K_FREE, fields)
end
local stats = {}
local granted = {}
local n = plan.need
if n > 0 then
  local nfree = redis.call('LLEN', K_FREE)
  if nfree > 0 then
    for _, b in ipairs(redis.call('LPOP', K_FREE, math.min(n, nfree))) do granted[#granted + 1] = tonumber(b) end
  end
  if #granted < n then
    local fresh = tonumber(redis.call('HGET', K_STATE, 'fresh')) or 0
    while #granted < n and fresh < plan.num_blocks do
      granted[#granted + 1] = fresh
      fresh = fresh + 1
    end
    redis.call('HSET', K_STATE, 'fresh', fresh)
  end
  if #granted < n then
    for _, b in ipairs(evict(n - #granted, nil, {}, stats)) do granted[#granted + 1] = b end
  end
  local add = {}
  for _, b in ipairs(granted) do add[#add + 1] = 0; add[#add + 1] = reserve_member(lease, b) end
  call_chunked('ZADD', K_RESERVE, add, 2)
  stats.blocks_allocated = #granted
end
if plan.attach then redis.call('ZADD', K_LEASES, 'GT', p.lease_deadline_ms, lease) end
incr_stats(stats)
return remember(K_REQUEST, p, reply({epoch = plan.epoch, granted = granted, num_reserved = plan.kept + #granted,
                                    cap = plan.cap}))
