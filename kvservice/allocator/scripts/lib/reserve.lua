--- @include "lib/pool"
--- @include "lib/chunked"
--- Lease reserves: blocks a lease holds in no table (K_RESERVE members "<lease>:<block>",
--- score 0, read by lexicographic range). A reserved block is neither free, evictable nor
--- referenced, and never has a hash.

local function reserve_member(lease, b)
  return lease .. ':' .. (D[b] or dec(b))
end

-- The blocks a lease has reserved in this pool.
local function reserved_blocks(lease)
  local members = redis.call('ZRANGEBYLEX', K_RESERVE, '[' .. lease .. ':', '(' .. lease .. ';')
  local out = {}
  for i, m in ipairs(members) do out[i] = tonumber(string.sub(m, #lease + 2)) end
  return out, members
end

-- Gives a lease's whole reserve back to the free list; returns how many blocks.
local function reclaim_reserve(lease)
  local blocks, members = reserved_blocks(lease)
  if #blocks == 0 then return 0 end
  local fields = {}
  for i, b in ipairs(blocks) do fields[i] = D[b] or dec(b) end
  call_chunked('ZREM', K_RESERVE, members)
  call_chunked('RPUSH', K_FREE, fields)
  return #blocks
end
