--- heartbeat: a worker's liveness signal; stamps the pool's meta with the Redis clock if
--- the worker's epoch is the pool's.
---
--- KEYS[1]: the pool's meta hash.
--- ARGV[1]: msgpack map {pool, epoch}
--- Returns msgpack {epoch, heartbeat_ms}; or an error (lib/codec): NOT_FOUND,
---   FAILED_PRECONDITION {epoch} (reason EPOCH_CHANGED: the pool was re-registered).
--- @include "lib/time"
--- @include "lib/codec"

local K_META = KEYS[1]
local p = args()
local m = redis.call('HMGET', K_META, 'epoch', 'num_blocks')
local current = tonumber(m[1])
if not current or not m[2] then
  return error_reply({code = 'NOT_FOUND', message = 'pool ' .. p.pool .. ' is not registered'})
end
if current ~= p.epoch then
  return error_reply({code = 'FAILED_PRECONDITION', extra = {epoch = current, reason = 'EPOCH_CHANGED'},
    message = 'pool ' .. p.pool .. ' is at epoch ' .. current .. ', not ' .. string.format('%d', p.epoch) ..
      ' (re-registered since)'})
end
local now = now_ms()
redis.call('HSET', K_META, 'heartbeat_ms', now)
return reply({epoch = current, heartbeat_ms = now})
