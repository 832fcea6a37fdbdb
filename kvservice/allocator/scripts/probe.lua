--- probe: read-only; how much of a prompt a pool has cached, and how many blocks it could
--- give (free + evictable, less what runs were admitted), for placing a create and for
--- admitting a large one (scripts/stage.lua). The caller sends a long chain in slices.
---
--- KEYS[1..28]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch, block_hashes = [hash hex of each block a hit may cover]}
--- Returns msgpack {epoch, hits (leading blocks cached), referenced (how many of those are
---   held by block tables: a create shares them without taking a block), available,
---   sequences (the pool's sequences: its load, for placement), silent_ms (how long since
---   its worker's last heartbeat, or since it registered if none yet)}; or an error (lib/codec):
---   NOT_FOUND.
--- @include "lib/time"
--- @include "lib/pool"
--- @include "lib/chunked"

local p = args()
local _, res = guarded(function()
  local epoch, num_blocks = pool_meta(p.pool)
  local hits, referenced = 0, 0
  if epoch == p.epoch and #p.block_hashes > 0 then
    local got = hmget_chunked(K_H2B, p.block_hashes)
    local fields = {}
    for i = 1, #got do
      if not got[i] then break end
      hits = i
      fields[i] = got[i]
    end
    if hits > 0 then
      for _, r in ipairs(hmget_chunked(K_REF, fields)) do
        if r then referenced = referenced + 1 end
      end
    end
  end
  local seen = redis.call('HMGET', K_META, 'heartbeat_ms', 'registered_ms')
  local since = tonumber(seen[1] or seen[2] or 0) or 0
  return reply({epoch = epoch, hits = hits, referenced = referenced, available = available_now(num_blocks),
                sequences = redis.call('HLEN', K_SEQS),
                silent_ms = since > 0 and math.max(0, now_ms() - since) or 0})
end)
return res
