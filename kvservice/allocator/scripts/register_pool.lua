--- register_pool: registers a pool, or re-registers it: a new epoch, and every block of
--- the old epoch free again (its sequences, cache entries, host-tier entries and leases
--- are dropped; the disk tier's confirmed entries may stay, below). On one
--- Redis the pool joins the registry in the same script, so a refused registration leaves
--- no trace; on a Redis Cluster the registry is on another slot, and the store adds the
--- pool to it after the script succeeded (KEYS[31] absent).
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31]: the request key;
--- KEYS[31] (optional): the pool registry (a set of pool ids).
--- ARGV[1]: msgpack map {pool, request_id, fingerprint, request_ttl_ms, num_blocks,
---   block_size, num_layers, num_kv_heads, head_dim, dtype, worker_address, host_entries,
---   disk_entries (the lower tiers' sizes, lib/tiers; 0: none), disk_kept (the worker's
---   disk tier holds what an earlier process stored: its ready entries are kept when the
---   geometry and the tier's size are unchanged; else the tier starts empty), role (both,
---   prefill or decode: what the engine runs there), grant_key (the new epoch's, hex:
---   kvservice/common/grants.py; not in the fingerprint)}
--- Returns msgpack {pool, epoch, generation (a new one: lib/generation), registered_ms,
---   grant_key}; or an error (lib/codec):
---   INVALID_ARGUMENT (a used request_id with other arguments).
--- @include "lib/time"
--- @include "lib/request"
--- @include "lib/pool"
--- @include "lib/generation"

local K_REQUEST, K_REGISTRY = KEYS[NUM_POOL_KEYS + 1], KEYS[NUM_POOL_KEYS + 2]
local p = args()
local prev = replay(K_REQUEST, p)
if prev then return prev end
local now = now_ms()
local epoch = redis.call('HINCRBY', K_META, 'epoch', 1)
local geometry = table.concat({p.num_blocks, p.block_size, p.num_layers, p.num_kv_heads, p.head_dim, p.dtype}, ' ')
local kept = p.disk_kept and p.disk_entries > 0 and
  redis.call('HGET', K_META, 'geometry') == geometry and
  tonumber(redis.call('HGET', K_META, 'disk_entries')) == p.disk_entries
for i = 2, EPOCH_KEYS do redis.call('UNLINK', KEYS[i]) end
if kept then
  -- The disk tier's ready entries outlive the epoch; copies never confirmed are dropped.
  local d = K_TIERS.d
  local lost = redis.call('ZRANGE', d.pend, 0, -1)
  for _, e in ipairs(lost) do
    local h = redis.call('HGET', d.e2h, e)
    if h and redis.call('HGET', d.h2e, h) == e then redis.call('HDEL', d.h2e, h) end
    redis.call('HDEL', d.e2h, e)
    redis.call('RPUSH', d.free, e)
  end
  redis.call('UNLINK', d.pend)
else
  for i = EPOCH_KEYS + 1, DISK_KEYS do redis.call('UNLINK', KEYS[i]) end
end
redis.call('HSET', K_META, 'pool_id', p.pool, 'num_blocks', p.num_blocks, 'block_size', p.block_size,
  'num_layers', p.num_layers, 'num_kv_heads', p.num_kv_heads, 'head_dim', p.head_dim,
  'dtype', p.dtype, 'worker_address', p.worker_address, 'registered_ms', now, 'geometry', geometry,
  'host_entries', p.host_entries, 'disk_entries', p.disk_entries, 'role', p.role or 'both',
  'events', p.events and 1 or 0, 'grant_key', p.grant_key)
EVENTS.on = nil
EVENTS.add('C', '', {})     -- (the new epoch starts empty; a disk tier kept is stored again)
if kept then
  local hs = {}
  for _, e in ipairs(redis.call('ZRANGE', K_TIERS.d.lru, 0, -1)) do hs[#hs + 1] = redis.call('HGET', K_TIERS.d.e2h, e) end
  EVENTS.add('S', 'STORAGE', hs)
end
redis.call('HDEL', K_META, 'heartbeat_ms', 'drained')
redis.call('HSET', K_STATE, 'fresh', 0, 'clock', 0)
local gen = begin_generation(K_META, server_run_id())
if K_REGISTRY then redis.call('SADD', K_REGISTRY, p.pool) end
return remember(K_REQUEST, p, reply({pool = p.pool, epoch = epoch, generation = gen, registered_ms = now,
  grant_key = p.grant_key}))
