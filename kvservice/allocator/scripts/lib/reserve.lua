--- @include "lib/pool"
--- @include "lib/chunked"
--- @include "lib/time"
--- Lease reserves: blocks a lease holds in no table. K_RESERVE: hash block id -> lease;
--- K_JOURNAL: hash lease -> "<applied> <reserved>", the number of the lease's last journal
--- entry applied and the size of its reserve. A Sync reads and writes only the fields of
--- the blocks it moves (never the whole reserve). A reserved block is neither free,
--- evictable nor referenced, and never has a hash.

-- The lease's journal position and reserve size.
local function lease_progress(lease)
  local v = redis.call('HGET', K_JOURNAL, lease)
  if not v then return 0, 0 end
  local sp = string.find(v, ' ', 1, true)
  return tonumber(string.sub(v, 1, sp - 1)), tonumber(string.sub(v, sp + 1))
end

local function set_lease_progress(lease, applied, reserved)
  redis.call('HSET', K_JOURNAL, lease, string.format('%d %d', applied, reserved))
end

-- Sequence numbers granted to a lease for its local forks: K_STATE "numbers:<lease>" =
-- "<first> <last> ..." of its last NUMBER_RANGES grants (the SDK uses them in order and
-- asks for more only when it holds fewer than a grant, so its unused ones lie in the last
-- two or three). A fork the lease made locally takes one before its entry is applied: a
-- resync accepts a claim of it.
local NUMBER_RANGES = 16

local function grant_numbers(lease, first, n)
  local field = 'numbers:' .. lease
  local ranges = {}
  for x in string.gmatch(redis.call('HGET', K_STATE, field) or '', '%d+') do ranges[#ranges + 1] = x end
  ranges[#ranges + 1] = string.format('%d', first)
  ranges[#ranges + 1] = string.format('%d', first + n - 1)
  while #ranges > 2 * NUMBER_RANGES do
    table.remove(ranges, 1)
    table.remove(ranges, 1)
  end
  redis.call('HSET', K_STATE, field, table.concat(ranges, ' '))
end

-- Whether ``n`` is among the numbers granted to the lease (grant_numbers), as a function.
local function granted_numbers(lease)
  local ranges = {}
  for x in string.gmatch(redis.call('HGET', K_STATE, 'numbers:' .. lease) or '', '%d+') do
    ranges[#ranges + 1] = tonumber(x)
  end
  return function(n)
    for i = 1, #ranges, 2 do
      if n >= ranges[i] and n <= ranges[i + 1] then return true end
    end
    return false
  end
end

-- Gives an ended lease's reserve back to the free list, scanning the pool's reserve hash
-- from where the previous call stopped (K_STATE "reclaim:<lease>") for about ``budget``
-- fields; returns how many blocks it gave back and whether the reserve is all back.
local function reclaim_reserve(lease, budget)
  local _, left = lease_progress(lease)
  if left == 0 then return 0, true end
  local mark = 'reclaim:' .. lease
  local cursor = redis.call('HGET', K_STATE, mark) or '0'
  local fields, seen = {}, 0
  repeat
    local got = redis.call('HSCAN', K_RESERVE, cursor, 'COUNT', 256)
    cursor = got[1]
    local kv = got[2]
    for i = 1, #kv, 2 do
      if kv[i + 1] == lease then fields[#fields + 1] = kv[i] end
    end
    seen = seen + #kv / 2
  until cursor == '0' or seen >= budget or #fields >= left
  if #fields > 0 then
    call_chunked('HDEL', K_RESERVE, fields)
    call_chunked('RPUSH', K_FREE, fields)
  end
  local done = cursor == '0' or #fields >= left
  if done then
    redis.call('HDEL', K_STATE, mark)
  else
    redis.call('HSET', K_STATE, mark, cursor)
    set_lease_progress(lease, 0, left - #fields)
  end
  return #fields, done
end

-- Checks a Sync's pool part (p: pool, epoch, lease_id, lease_left_ms): the epoch and
-- the lease. Returns the pool's epoch, num_blocks, block_size, whether the lease must
-- be attached to the pool (``resyncing``: see lease_in_pool) and the pool's generation.
local function check_sync_target(p, resyncing)
  local epoch, num_blocks, bs, gen = pool_meta(p.pool)
  if p.epoch ~= epoch then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at epoch ' .. epoch .. ', not ' ..
      string.format('%d', p.epoch) .. ' (re-registered since)', {reason = 'EPOCH_CHANGED', epoch = epoch})
  end
  local attach = lease_in_pool(p.pool, p.lease_id, p.lease_left_ms, now_ms(), true, resyncing)
  return epoch, num_blocks, bs, attach, gen
end

-- The keep-alive's side of a Sync in this pool (as lease_touch), first, whatever becomes
-- of the rest: the lease's deadline raised to this shard's clock + p.touch_left_ms where
-- the pool knows it.
local function touch_lease(p)
  if p.touch_left_ms > 0 and redis.call('ZSCORE', K_LEASES, p.lease_id) then
    extend_lease(p.lease_id, p.touch_left_ms, now_ms())
  end
end
