--- pin: pins, for a fetch by another pool's worker (DESIGN §13), the leading blocks of a
--- chain of hashes that this pool holds ready to be read: a device block that no block
--- table holds (the sequences that wrote it have ended; pins may hold it), else a ready
--- entry of a lower tier. The first hash it holds none of so ends the pin. Or (blocks) the
--- device blocks of a live sequence that migrates to another pool: each must be referenced
--- (its table holds it). Expired pins are released first (lib/pins).
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, epoch (the pool's as the caller knows it), pin_id, ttl_ms
---   (the pin's deadline is this shard's clock + ttl_ms), block_hashes = [hash hex, in
---   chain order], blocks (optional, instead: [device block id])}
--- Returns msgpack {epoch, pinned = [[tier code (0 device, 1 host, 2 disk), block or
---   entry]] (one per leading hash pinned, or per block; none: nothing pinned, no record),
---   serial (the pool's change counter after the pin: the fetch orders' pull serial)};
---   or an error (lib/codec): NOT_FOUND, FAILED_PRECONDITION (reason EPOCH_CHANGED; a block
---   no table holds), INVALID_ARGUMENT (a pin id in use).
--- @include "lib/time"
--- @include "lib/tiers"

local p = args()
local _, res = guarded(function()
  local epoch = pool_meta(p.pool)
  if epoch ~= p.epoch then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at epoch ' .. epoch .. ', not ' .. p.epoch,
      {reason = 'EPOCH_CHANGED'})
  end
  if redis.call('HEXISTS', K_PINS, 'p:' .. p.pin_id) == 1 then
    bad('INVALID_ARGUMENT', 'pin ' .. p.pin_id .. ' exists in pool ' .. p.pool)
  end
  local now = now_ms()
  local swept = PINS.sweep(now)
  local items, pinned = {}, {}
  for _, id in ipairs(p.blocks or {}) do
    local b = string.format('%d', id)
    local r = tonumber(redis.call('HGET', K_REF, b)) or 0
    if r <= PINS.on_block(b) then
      bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ': block ' .. b .. ' is held by no block table')
    end
  end
  for _, id in ipairs(p.blocks or {}) do
    local b = string.format('%d', id)
    redis.call('HINCRBY', K_REF, b, 1)
    items[#items + 1] = {'b', b}
    pinned[#pinned + 1] = {0, id}
  end
  for _, h in ipairs(p.blocks and {} or p.block_hashes) do
    local got = false
    local b = redis.call('HGET', K_H2B, h)
    if b then
      local r = tonumber(redis.call('HGET', K_REF, b)) or 0
      if r == PINS.on_block(b) then
        if r == 0 then redis.call('ZREM', K_EVICT, b) end
        redis.call('HSET', K_REF, b, r + 1)
        items[#items + 1] = {'b', b}
        pinned[#pinned + 1] = {0, tonumber(b)}
        got = true
      end
    end
    if not got then
      local t, e = TIER.hit(h)
      if not t then break end
      items[#items + 1] = {t, e}
      TIER.touch(t, e)
      pinned[#pinned + 1] = {TIER.code[t], tonumber(e)}
    end
  end
  local stats = {fetch_pins = #items > 0 and 1 or 0, fetch_pinned_blocks = #items, fetch_pins_expired = swept}
  if #items > 0 then PINS.add(p.pin_id, now + p.ttl_ms, items) end
  local serial = 0
  if #items > 0 or swept > 0 then serial = changed() end
  incr_stats(stats)
  return reply({epoch = epoch, pinned = pinned, serial = serial})
end)
return res
