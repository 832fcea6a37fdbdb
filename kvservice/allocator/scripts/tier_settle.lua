--- tier_settle: the worker's word on the lower-tier orders of one pool (lib/tiers), as its
--- client passes it on: each copy down a tier that succeeded makes its pending entry ready;
--- a copy that failed, or a load whose bytes failed their checksum, drops the entry (its
--- content is recomputed when next needed: wrong KV is never served). Also releases the
--- read pins of fetches from this pool that are done (lib/pins), and forgets the hash of
--- each device block that a load or fetch failed to fill (its content is not what the hash
--- says), when the block still holds that hash: no create, load or fetch reads it after
--- this; a lower tier entry of that hash goes too (it may be a copy of that content), unless
--- a fetch pins it; a cached block that no table holds becomes free. (The allocator checked
--- that each settlement and forget is one of its orders.)
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch (the pool's epoch when the orders were given),
---   settled = [[tier code (1 host, 2 disk), entry, hash hex, ok]], release = [pin id]
---   (optional), forget = [[device block id, hash hex]] (optional), lease, unwritten =
---   [[sequence number, first block (0-based)]] (optional: the blocks of a sequence of the
---   lease, from that block on, whose KV its forward never wrote; a block of the
---   sequence's cached prefix, which others wrote, is never one of them)}
--- Returns msgpack {epoch, settled (how many entries still held their hash and were
---   settled; the others were taken back or reused meanwhile), released (pins released;
---   the others were gone: released or past their deadline), forgotten (blocks of forget
---   that held their hash)}; or an error (lib/codec):
---   NOT_FOUND, FAILED_PRECONDITION (reason EPOCH_CHANGED: orders of an earlier epoch,
---   whose entries were dropped or freed when the pool re-registered).
--- @include "lib/tiers"
--- @include "lib/records"

local p = args()
local _, res = guarded(function()
  local epoch, _, bs = pool_meta(p.pool)
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
  local forgotten = 0
  local function forget(b, want)
    local h = redis.call('HGET', K_B2H, b)
    if not h or (want and h ~= want) then return end
    forgotten = forgotten + 1
    redis.call('HDEL', K_B2H, b)
    if redis.call('HGET', K_H2B, h) == b then
      redis.call('HDEL', K_H2B, h)
      EVENTS.add('R', 'GPU', {h})
    end
    if redis.call('ZREM', K_EVICT, b) == 1 then redis.call('RPUSH', K_FREE, b) end
    for _, t in ipairs(TIER.name) do
      if TIER.entries(t) > 0 then
        local e = redis.call('HGET', K_TIERS[t].h2e, h)
        if e and not PINS.holds(t, e) then TIER.drop(t, e) end
      end
    end
  end
  for _, f in ipairs(p.forget or {}) do
    forget(string.format('%d', f[1]), f[2])
  end
  if p.unwritten and #p.unwritten > 0 then
    for _, u in ipairs(p.unwritten) do
      local f = string.format('%d', u[1])
      local meta = redis.call('HGET', K_SEQS, f)
      local rec = meta and load_rec(f, meta)
      if rec and rec.st == '' and rec.l == p.lease then
        for i = math.max(u[2], math.floor(rec.k / bs)) + 1, rec.nb do
          forget(string.format('%d', rec_block(rec, i)))
        end
      end
    end
  end
  stats.forgotten_blocks = forgotten
  if n + released + forgotten > 0 then changed() end
  incr_stats(stats)
  return reply({epoch = epoch, settled = n, released = released, forgotten = forgotten})
end)
return res
