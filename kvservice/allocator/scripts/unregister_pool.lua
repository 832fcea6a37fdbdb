--- unregister_pool: removes a drained pool (`kvservice drain`, DESIGN §13). Refused while it
--- holds a sequence, a reserved block or a live read pin, unless force (what it held is
--- then dropped with it). Every key of its epoch and its disk tier's are dropped; its meta
--- keeps pool_id, epoch and drained: its worker's heartbeat learns that the pool was
--- drained (scripts/heartbeat.lua) until the pool is registered again.
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31] (optional): the
--- pool registry (a set of pool ids; on a Redis Cluster another slot: the store removes
--- the pool from it after the script).
--- ARGV[1]: msgpack map {pool, force}
--- Returns msgpack {epoch, sequences, reserved, pins (what the pool held when it was
---   dropped)}; or an error (lib/codec): NOT_FOUND, FAILED_PRECONDITION {sequences,
---   reserved, pins} (reason NOT_DRAINED: it holds something).
--- @include "lib/time"
--- @include "lib/pins"

local K_REGISTRY = KEYS[NUM_POOL_KEYS + 1]
local p = args()
local _, res = guarded(function()
  local epoch = pool_meta(p.pool)
  PINS.sweep(now_ms())
  local held = {sequences = redis.call('HLEN', K_SEQS), reserved = redis.call('HLEN', K_RESERVE),
                pins = redis.call('HLEN', K_PINS) > 0 and 1 or 0}
  if not p.force and (held.sequences > 0 or held.reserved > 0 or held.pins > 0) then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' holds ' .. held.sequences .. ' sequences, ' .. held.reserved ..
      ' reserved blocks and ' .. (held.pins > 0 and 'live' or 'no') .. ' read pins: not drained yet',
      {reason = 'NOT_DRAINED', sequences = held.sequences, reserved = held.reserved, pins = held.pins})
  end
  for i = 2, DISK_KEYS do redis.call('UNLINK', KEYS[i]) end
  EVENTS.add('C', '', {})
  local pool_id = redis.call('HGET', K_META, 'pool_id')
  redis.call('UNLINK', K_META)
  redis.call('HSET', K_META, 'pool_id', pool_id or p.pool, 'drained', epoch, 'epoch', epoch)
  if K_REGISTRY then redis.call('SREM', K_REGISTRY, p.pool) end
  return reply({epoch = epoch, sequences = held.sequences, reserved = held.reserved, pins = held.pins})
end)
return res
