--- @include "lib/pool"
--- @include "lib/time"
--- @include "lib/pins"
--- The pool's lower tiers (DESIGN §12): 'h' (host memory) and 'd' (a file on disk) of the
--- pool's worker, each a fixed number of entries (K_META host_entries / disk_entries; 0:
--- no such tier) that hold one full, hashed block each. Per tier (K_TIERS[t]): state
--- {fresh, clock}, a free list, h2e / e2h (hash <-> entry), lru (ready entries -> clock) and
--- pend (entries whose copy the worker has not confirmed -> when it was ordered, ms).
---
--- Orders for the worker are lists {src_tier, src, dst_tier, dst, hash} (tiers: 0 device,
--- 1 host, 2 disk), run by the worker in the order given: a script that returns them sets
--- TIER.orders = {} first (nil: a device block evicted loses its content, as without tiers).
---   device -> host  a hashed device block evicted (lib/refs evict()) is copied down before
---                   its new owner writes it: the entry is pending until confirmed
---   host -> disk    a ready host entry evicted for another is copied to the disk tier first
---   host/disk -> device  a prefix hit in a lower tier (scripts/step.lua): loaded into the
---                   create's new device block before the forward that reads it
--- A pending entry is never a hit; one not confirmed within PENDING_TTL_MS is taken back
--- (its copy was lost with its worker or its client).
local TIER = {orders = nil, size = {}, protect = {h = {}, d = {}}, code = {h = 1, d = 2}, name = {'h', 'd'},
              PENDING_TTL_MS = 60000, now = nil}

function TIER.entries(t)
  local n = TIER.size[t]
  if n == nil then
    n = tonumber(redis.call('HGET', K_META, t == 'h' and 'host_entries' or 'disk_entries')) or 0
    TIER.size[t] = n
  end
  return n
end

function TIER.clock()
  if TIER.now == nil then TIER.now = now_ms() end
  return TIER.now
end

-- Forgets entry e (decimal string) of tier t: its hash (if the hash still names it) and
-- its pending / LRU membership. The caller reuses it or frees it.
function TIER.forget(t, e)
  local k = K_TIERS[t]
  local h = redis.call('HGET', k.e2h, e)
  if h then
    if redis.call('HGET', k.h2e, h) == e then redis.call('HDEL', k.h2e, h) end
    redis.call('HDEL', k.e2h, e)
  end
  if redis.call('ZREM', k.lru, e) == 1 and h then EVENTS.add('R', EVENTS.MEDIUM[t], {h}) end
  redis.call('ZREM', k.pend, e)
  return h
end

-- Drops entry e of tier t (its hash, its state) and frees it.
function TIER.drop(t, e)
  TIER.forget(t, e)
  redis.call('RPUSH', K_TIERS[t].free, e)
end

function TIER.pending(t, e, h)
  local k = K_TIERS[t]
  redis.call('HSET', k.h2e, h, e)
  redis.call('HSET', k.e2h, e, h)
  redis.call('ZADD', k.pend, TIER.clock(), e)
end

function TIER.touch(t, e)
  local k = K_TIERS[t]
  local c = redis.call('HINCRBY', k.state, 'clock', 1)
  redis.call('ZADD', k.lru, c, e)
end

local function tier_stat(stats, t, name, n)
  local f = 'tier_' .. t .. '_' .. name
  stats[f] = (stats[f] or 0) + (n or 1)
end

-- An entry of tier t for new content (decimal string), or nil: a free one, a never-used
-- one, a pending one whose copy was lost (older than PENDING_TTL_MS), or the least
-- recently used ready one not loaded by this call nor pinned by a fetch (lib/pins; a host
-- entry goes down to the disk tier first, when there is one and it lacks that hash).
function TIER.take(t, stats)
  local k = K_TIERS[t]
  local e = redis.call('LPOP', k.free)
  if e then return e end
  local fresh = tonumber(redis.call('HGET', k.state, 'fresh')) or 0
  if fresh < TIER.entries(t) then
    redis.call('HSET', k.state, 'fresh', fresh + 1)
    return string.format('%d', fresh)
  end
  local stale = redis.call('ZRANGEBYSCORE', k.pend, '-inf', TIER.clock() - TIER.PENDING_TTL_MS, 'LIMIT', 0, 1)
  if #stale > 0 then
    TIER.forget(t, stale[1])
    tier_stat(stats, t, 'lost_copies')
    return stale[1]
  end
  local victim = nil
  for _, s in ipairs(redis.call('ZRANGE', k.lru, 0, 15)) do
    if not TIER.protect[t][s] and not PINS.holds(t, s) then victim = s; break end
  end
  if not victim then return nil end
  local h = TIER.forget(t, victim)
  tier_stat(stats, t, 'evictions')
  if t == 'h' and h and TIER.entries('d') > 0 and redis.call('HEXISTS', K_TIERS.d.h2e, h) == 0 then
    local d = TIER.take('d', stats)
    if d then
      TIER.pending('d', d, h)
      TIER.orders[#TIER.orders + 1] = {1, tonumber(victim), 2, tonumber(d), h}
      tier_stat(stats, 'd', 'offloads')
    end
  end
  return victim
end

-- A hashed device block b whose hash h leaves the device tier (evicted): copied down to
-- the host tier, unless a lower tier holds h already or no script takes orders.
function TIER.offload(b, h, stats)
  if TIER.orders == nil or TIER.entries('h') == 0 then return end
  if redis.call('HEXISTS', K_TIERS.h.h2e, h) == 1 or
      (TIER.entries('d') > 0 and redis.call('HEXISTS', K_TIERS.d.h2e, h) == 1) then
    return
  end
  local e = TIER.take('h', stats)
  if not e then return end
  TIER.pending('h', e, h)
  TIER.orders[#TIER.orders + 1] = {0, b, 1, tonumber(e), h}
  tier_stat(stats, 'h', 'offloads')
end

-- A ready entry that holds hash h: tier, entry (decimal string); or nil. Read only: the
-- entry is kept from eviction for the rest of the call (the caller touches it once the
-- call is planned).
function TIER.hit(h)
  for _, t in ipairs(TIER.name) do
    if TIER.entries(t) > 0 then
      local e = redis.call('HGET', K_TIERS[t].h2e, h)
      if e and redis.call('ZSCORE', K_TIERS[t].lru, e) then
        TIER.protect[t][e] = true
        return t, e
      end
    end
  end
  return nil
end

-- The worker's word on one order's destination entry e of tier t, that should hold hash
-- h: ok, the pending entry becomes ready; not ok (the copy, or a load from it, failed),
-- the entry is dropped and freed. Returns whether the entry still held h.
function TIER.settle(t, e, h, ok, stats)
  local k = K_TIERS[t]
  if redis.call('HGET', k.e2h, e) ~= h then return false end
  local since = tonumber(redis.call('ZSCORE', k.pend, e))
  if ok then
    if not since then return true end      -- (ready already: a repeated confirmation)
    redis.call('ZREM', k.pend, e)
    TIER.touch(t, e)
    EVENTS.add('S', EVENTS.MEDIUM[t], {h})
    tier_stat(stats, t, 'confirmed')
    tier_stat(stats, t, 'lag_ms', math.max(0, TIER.clock() - since))
  else
    TIER.drop(t, e)
    tier_stat(stats, t, since and 'failed_copies' or 'load_failures')
  end
  return true
end
