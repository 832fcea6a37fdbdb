--- @include "lib/pool"
--- @include "lib/chunked"
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

-- Gives a lease's whole reserve back to the free list; returns how many blocks. (Reads
-- the pool's whole reserve hash: only when a lease ends.)
local function reclaim_reserve(lease)
  local all = redis.call('HGETALL', K_RESERVE)
  local fields = {}
  for i = 1, #all, 2 do
    if all[i + 1] == lease then fields[#fields + 1] = all[i] end
  end
  if #fields == 0 then return 0 end
  call_chunked('HDEL', K_RESERVE, fields)
  call_chunked('RPUSH', K_FREE, fields)
  return #fields
end
