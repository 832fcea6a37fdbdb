--- probe: read-only; how much of a prompt a pool has cached, and how many blocks it could
--- give (free + evictable), for placing a create.
---
--- KEYS[1..16]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch, block_hashes = [hash hex of each block a hit may cover]}
--- Returns msgpack {epoch, hits (leading blocks cached), available}; or an error
---   (lib/codec): NOT_FOUND.
--- @include "lib/pool"
--- @include "lib/chunked"

local p = args()
local _, res = guarded(function()
  local epoch, num_blocks = pool_meta(p.pool)
  local hits = 0
  if epoch == p.epoch and #p.block_hashes > 0 then
    local got = hmget_chunked(K_H2B, p.block_hashes)
    for i = 1, #got do
      if not got[i] then break end
      hits = i
    end
  end
  return reply({epoch = epoch, hits = hits, available = available_now(num_blocks)})
end)
return res
