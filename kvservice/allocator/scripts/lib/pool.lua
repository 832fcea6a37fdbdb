--- @include "lib/codec"
--- @include "lib/generation"
--- The 30 keys of one pool, in the order kvservice/allocator/keys.py passes them
--- (KEYS[1..30]: 16 of the device tier, the read pins (lib/pins), then 6 of the host tier and 6 of the disk tier,
--- lib/tiers, and the stream of its KV events), the pool's registration record and its counters.
local K_META, K_STATE, K_FREE, K_EVICT, K_REF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_H2B, K_B2H, K_SEQS, K_LEASES, K_LSEQ = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_DEAD, K_STATS, K_TABS, K_RESERVE, K_JOURNAL = KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15]
local K_HELD, K_PINS = KEYS[16], KEYS[17]
-- The lower tiers' keys (lib/tiers): per tier state, free, h2e, e2h, lru, pend.
local K_TIERS = {h = {state = KEYS[18], free = KEYS[19], h2e = KEYS[20], e2h = KEYS[21], lru = KEYS[22], pend = KEYS[23]},
                 d = {state = KEYS[24], free = KEYS[25], h2e = KEYS[26], e2h = KEYS[27], lru = KEYS[28], pend = KEYS[29]}}
local K_EVENTS = KEYS[30]
local NUM_POOL_KEYS = 30
-- KEYS[EPOCH_KEYS + 1 .. DISK_KEYS]: the disk tier's.
local DISK_KEYS = 29
-- KEYS[2 .. EPOCH_KEYS] belong to one epoch (dropped on re-registration); the disk tier's
-- may outlive it (scripts/register_pool.lua).
local EPOCH_KEYS = 23

-- Returns epoch, num_blocks, block_size and generation (lib/generation: a new one if the
-- Redis serving the pool changed) of a registered pool; raises NOT_FOUND otherwise.
local function pool_meta(pool_id)
  local m = redis.call('HMGET', K_META, 'epoch', 'num_blocks', 'block_size', 'generation', 'server')
  if not m[1] or not m[2] then bad('NOT_FOUND', 'pool ' .. pool_id .. ' is not registered') end
  return tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), current_generation(K_META, m[4], m[5])
end

-- Refuses a call whose generation (p.generation, as the caller heard it; 0: none, the
-- caller holds nothing here) is not the pool's ``gen``: FAILED_PRECONDITION, reason
-- ROLLED_BACK, with the pool's.
local function check_generation(p, gen)
  local known = p.generation or 0
  if known ~= 0 and known ~= gen then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at generation ' .. string.format('%d', gen) .. ', not ' ..
      string.format('%d', known) .. ': the Redis serving it restarted or failed over, so its state may have ' ..
      'rolled back; resynchronise with it first', {reason = 'ROLLED_BACK', generation = gen})
  end
end

-- The pool's generation, checked (check_generation) before anything else is read or
-- replayed; NOT_FOUND for an unregistered pool.
local function checked_generation(p)
  local _, _, _, gen = pool_meta(p.pool)
  check_generation(p, gen)
  return gen
end

-- Whether a lease must be attached to the pool by this call (true) or is live in it
-- already (false). A lease the pool does not know is attached when ``attachable``, with
-- the time it has left as the caller read it from the lease's own record, ``left_ms``
-- (0: none read: the internal LEASE_UNKNOWN asks the caller to attach it first): its
-- deadline here is this shard's clock + left_ms (a lease's record may live on another
-- shard, whose clock is not this one's). LEASE_EXPIRED for a lease that the pool saw
-- expire or be revoked, or that has no time left. While the lease resyncs
-- in parts (K_STATE "resync:<lease>", scripts/resync.lua) its records are the resync's
-- alone: any other call of it fails (FAILED_PRECONDITION, reason RESYNC_IN_PROGRESS),
-- unless ``resyncing`` (the resync's own parts).
local function lease_in_pool(pool, lease, left_ms, now, attachable, resyncing)
  local deadline = tonumber(redis.call('ZSCORE', K_LEASES, lease))
  if deadline and deadline > now then
    if not resyncing and redis.call('HEXISTS', K_STATE, 'resync:' .. lease) == 1 then
      bad('FAILED_PRECONDITION', 'lease ' .. lease .. ' is resynchronising its state in pool ' .. pool ..
        '; nothing else of it runs there until the resync is done', {reason = 'RESYNC_IN_PROGRESS'})
    end
    return false
  end
  if deadline or redis.call('ZSCORE', K_DEAD, lease) then
    bad('FAILED_PRECONDITION', 'lease ' .. lease .. ' has expired or was revoked; its sequences were freed',
      {reason = 'LEASE_EXPIRED'})
  end
  if not attachable then return false end
  if left_ms == 0 then bad('LEASE_UNKNOWN', 'lease ' .. lease .. ' is not attached to ' .. pool) end
  if not (left_ms > 0) then
    bad('FAILED_PRECONDITION', 'lease ' .. lease .. ' has expired', {reason = 'LEASE_EXPIRED'})
  end
  return true
end

-- Raises the lease's deadline in the pool to ``now`` (this shard's clock) + ``left_ms``: a
-- time left that the caller read from the lease's own record, maybe on another shard's clock.
local function extend_lease(lease, left_ms, now)
  redis.call('ZADD', K_LEASES, 'GT', now + left_ms, lease)
end

-- Blocks the pool could give now: free, never used, and evictable, less those admitted
-- to runs and not taken yet (lib/runs: they are the runs' already).
local function available_now(num_blocks)
  local st = redis.call('HMGET', K_STATE, 'fresh', 'admitted')
  local fresh, admitted = tonumber(st[1]) or 0, tonumber(st[2]) or 0
  return redis.call('LLEN', K_FREE) + (num_blocks - fresh) + redis.call('ZCARD', K_EVICT) - admitted
end

-- Every script that changes the pool's state raises its change counter, so that a reader
-- in pieces (the audit's snapshot) can tell whether it read one state. Its new value is the
-- serial of the grants of what the script gave (kvservice/common/grants.py): of two grants
-- of one block, the later one's is larger.
local function changed()
  return redis.call('HINCRBY', K_STATE, 'version', 1)
end

-- KV events (DESIGN §15, docs/integrations.md): the pool's cache changes appended to its
-- stream (K_EVENTS) by the script that makes them, when its registration asked for them
-- (meta events = 1): kind S (stored), R (removed) or C (all cleared), the medium (GPU: the
-- device, CPU: the host tier, STORAGE: the disk tier) and the hashes (hex, one after the
-- other). ``kvservice events`` publishes them in vLLM's format.
local EVENTS = {on = nil, MAXLEN = 100000, MEDIUM = {h = 'CPU', d = 'STORAGE'}}
function EVENTS.add(kind, medium, hashes)
  if EVENTS.on == nil then EVENTS.on = redis.call('HGET', K_META, 'events') == '1' end
  if not EVENTS.on or (kind ~= 'C' and #hashes == 0) then return end
  redis.call('XADD', K_EVENTS, 'MAXLEN', '~', EVENTS.MAXLEN, '*', 'k', kind, 'm', medium, 'h', table.concat(hashes))
end

local function incr_stats(stats)
  for k, v in pairs(stats) do
    if v ~= 0 then redis.call('HINCRBY', K_STATS, k, v) end
  end
end
