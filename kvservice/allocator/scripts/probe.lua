--- probe: read-only; how much of a prompt a pool has cached, and how many blocks it could
--- give (free + evictable, less what runs were admitted), for placing a create and for
--- admitting a large one (scripts/stage.lua). The caller sends a long chain in slices.
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch, block_hashes = [hash hex of each block a hit may cover],
---   tiers (optional: the chain goes on through the lower tiers' ready entries, as the
---   lookup of a create whose client runs loads)}
--- Returns msgpack {epoch, hits (leading blocks cached on the device), referenced (how many
---   of those are held by block tables: a create shares them without taking a block),
---   chain, host, disk (with tiers: the leading blocks cached on the device or ready in a
---   lower tier, and how many of those a host / disk entry would load; else chain = hits),
---   available, sequences (the pool's sequences: its load, for placement), silent_ms (how
---   long since its worker's last heartbeat, or since it registered if none yet)}; or an
---   error (lib/codec): NOT_FOUND.
--- @include "lib/time"
--- @include "lib/pool"
--- @include "lib/chunked"
--- @include "lib/tiers"

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
  local chain, lower = hits, {h = 0, d = 0}
  if epoch == p.epoch and p.tiers then
    -- (one block at a time past the device's leading hits, as a create's lookup goes:
    -- a block on the device is shared, one in a ready entry loaded, the first miss ends it)
    for i = hits + 1, #p.block_hashes do
      local h = p.block_hashes[i]
      if redis.call('HEXISTS', K_H2B, h) == 0 then
        local t = TIER.hit(h)
        if not t then break end
        lower[t] = lower[t] + 1
      end
      chain = i
    end
  end
  local seen = redis.call('HMGET', K_META, 'heartbeat_ms', 'registered_ms')
  local since = tonumber(seen[1] or seen[2] or 0) or 0
  return reply({epoch = epoch, hits = hits, referenced = referenced, chain = chain, host = lower.h, disk = lower.d,
                available = available_now(num_blocks),
                sequences = redis.call('HLEN', K_SEQS),
                silent_ms = since > 0 and math.max(0, now_ms() - since) or 0})
end)
return res
