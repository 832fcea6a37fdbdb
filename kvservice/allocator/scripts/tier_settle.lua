--- tier_settle: the worker's word on the lower-tier orders of one pool (lib/tiers), as its
--- client passes it on: each copy down a tier that succeeded makes its pending entry ready;
--- a copy that failed, or a load whose bytes failed their checksum, drops the entry (its
--- content is recomputed when next needed: wrong KV is never served). Also releases the
--- read pins of fetches from this pool that are done (lib/pins).
---
--- KEYS[1..29]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch (the pool's epoch when the orders were given),
---   settled = [[tier code (1 host, 2 disk), entry, hash hex, ok]], release = [pin id]
---   (optional)}
--- Returns msgpack {epoch, settled (how many entries still held their hash and were
---   settled; the others were taken back or reused meanwhile), released (pins released;
---   the others were gone: released or past their deadline)}; or an error (lib/codec):
---   NOT_FOUND, FAILED_PRECONDITION (reason EPOCH_CHANGED: orders of an earlier epoch,
---   whose entries were dropped or freed when the pool re-registered).
--- @include "lib/tiers"

local p = args()
local _, res = guarded(function()
  local epoch = pool_meta(p.pool)
  if epoch ~= p.epoch then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at epoch ' .. epoch .. ', not ' .. p.epoch ..
      ': its worker restarted and the orders of its earlier epoch are void', {reason = 'EPOCH_CHANGED'})
  end
  local stats, n = {}, 0
  for _, s in ipairs(p.settled) do
    local t = TIER.name[s[1]]
    if not t or TIER.entries(t) == 0 then
      bad('INVALID_ARGUMENT', 'pool ' .. p.pool .. ' has no tier ' .. tostring(s[1]))
    end
    if TIER.settle(t, string.format('%d', s[2]), s[3], s[4], stats) then n = n + 1 end
  end
  local released = 0
  for _, id in ipairs(p.release or {}) do
    if PINS.release(id) then released = released + 1 end
  end
  if n + released > 0 then changed() end
  incr_stats(stats)
  return reply({epoch = epoch, settled = n, released = released})
end)
return res
