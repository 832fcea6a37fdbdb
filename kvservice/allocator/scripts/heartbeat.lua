--- heartbeat: a worker's liveness signal; stamps the pool's meta with the Redis clock if
--- the worker's epoch is the pool's, and tells it the leases that died in the pool since
--- dead_since_ms (it refuses their writes).
---
--- KEYS[1]: the pool's meta hash; KEYS[2]: the pool's dead-lease tombstones (zset).
--- ARGV[1]: msgpack map {pool, epoch, dead_since_ms, max_dead}
--- Returns msgpack {epoch, generation (the pool's: lib/generation), heartbeat_ms, dead =
---   [lease ids, oldest first, at most max_dead], dead_until_ms (the tombstone time of
---   the last one, or dead_since_ms)};
---   or an error (lib/codec): NOT_FOUND, FAILED_PRECONDITION {epoch} (reason
---   EPOCH_CHANGED: the pool was re-registered; reason DRAINED: it was drained and
---   unregistered, scripts/unregister_pool.lua).
--- @include "lib/time"
--- @include "lib/codec"
--- @include "lib/generation"

local K_META, K_DEAD = KEYS[1], KEYS[2]
local p = args()
local m = redis.call('HMGET', K_META, 'epoch', 'num_blocks', 'generation', 'server', 'drained')
local current = tonumber(m[1])
if m[5] and tonumber(m[5]) == p.epoch then
  return error_reply({code = 'FAILED_PRECONDITION', extra = {epoch = current, reason = 'DRAINED'},
    message = 'pool ' .. p.pool .. ' was drained and unregistered (kvservice drain): its worker may stop'})
end
if not current or not m[2] then
  return error_reply({code = 'NOT_FOUND', message = 'pool ' .. p.pool .. ' is not registered'})
end
if current ~= p.epoch then
  return error_reply({code = 'FAILED_PRECONDITION', extra = {epoch = current, reason = 'EPOCH_CHANGED'},
    message = 'pool ' .. p.pool .. ' is at epoch ' .. current .. ', not ' .. string.format('%d', p.epoch) ..
      ' (re-registered since)'})
end
local gen = current_generation(K_META, m[3], m[4])
local now = now_ms()
redis.call('HSET', K_META, 'heartbeat_ms', now)
-- Tombstones share a millisecond now and then: from dead_since_ms inclusive, so that a
-- lease reaped in the same millisecond as the last one returned is not skipped (a lease
-- seen twice is harmless).
local got = redis.call('ZRANGEBYSCORE', K_DEAD, p.dead_since_ms, '+inf', 'WITHSCORES', 'LIMIT', 0, p.max_dead)
local dead, until_ms = {}, p.dead_since_ms
for i = 1, #got, 2 do
  dead[#dead + 1] = got[i]
  until_ms = tonumber(got[i + 1])
end
return reply({epoch = current, generation = gen, heartbeat_ms = now, dead = dead, dead_until_ms = until_ms})
