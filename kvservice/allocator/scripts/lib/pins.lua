--- @include "lib/pool"
--- Read pins (DESIGN §13): the device blocks and lower-tier entries of this pool that
--- another pool's worker is fetching, kept from eviction until the fetch is done (the
--- pin is released: scripts/tier_settle.lua) or its deadline passes (swept by the next
--- script that pins, and by the reaper). K_PINS (kvservice/allocator/keys.py):
---   p:<pin id>      "<deadline ms> <kind>:<index> ..." (kind b device block, h / d entry)
---   b:<block>, h:<entry>, d:<entry>   how many live pins hold it; a pinned device block
---                   also holds one reference (K_REF) per pin, so nothing evicts it
---   next            the earliest deadline of a live pin (ms)
local PINS = {}

-- Whether a live pin holds entry e (decimal string) of tier t ('h' or 'd').
function PINS.holds(t, e)
  return redis.call('HEXISTS', K_PINS, t .. ':' .. e) == 1
end

-- How many pins hold device block b (decimal string).
function PINS.on_block(b)
  return tonumber(redis.call('HGET', K_PINS, 'b:' .. b)) or 0
end

local function count(field, by)
  local n = redis.call('HINCRBY', K_PINS, field, by)
  if n <= 0 then redis.call('HDEL', K_PINS, field) end
end

-- Records pin `id` over `items` ({kind, index} pairs, index a decimal string) until
-- `deadline` (ms); a device block's reference is the caller's to take.
function PINS.add(id, deadline, items)
  local parts = {string.format('%d', deadline)}
  for _, it in ipairs(items) do
    parts[#parts + 1] = it[1] .. ':' .. it[2]
    count(it[1] .. ':' .. it[2], 1)
  end
  redis.call('HSET', K_PINS, 'p:' .. id, table.concat(parts, ' '))
  local nxt = tonumber(redis.call('HGET', K_PINS, 'next'))
  if not nxt or deadline < nxt then redis.call('HSET', K_PINS, 'next', deadline) end
end

-- Undoes a pin record's value: its counts, and its device blocks' references (a block
-- that no one references any more is evictable again, or free if it lost its hash).
local function undo(v)
  local first = true
  for item in string.gmatch(v, '%S+') do
    if first then
      first = false
    else
      count(item, -1)
      if item:sub(1, 1) == 'b' then
        local b = item:sub(3)
        if redis.call('HINCRBY', K_REF, b, -1) <= 0 then
          redis.call('HDEL', K_REF, b)
          if redis.call('HEXISTS', K_B2H, b) == 1 then
            redis.call('ZADD', K_EVICT, redis.call('HINCRBY', K_STATE, 'clock', 1), b)
          else
            redis.call('RPUSH', K_FREE, b)
          end
        end
      end
    end
  end
end

-- Releases pin `id`; false if it is gone already (released, or swept past its deadline).
function PINS.release(id)
  local v = redis.call('HGET', K_PINS, 'p:' .. id)
  if not v then return false end
  redis.call('HDEL', K_PINS, 'p:' .. id)
  undo(v)
  if redis.call('HLEN', K_PINS) == 1 then redis.call('HDEL', K_PINS, 'next') end   -- (the last pin)
  return true
end

-- Releases every pin whose deadline is at or before `now` (ms); returns how many.
function PINS.sweep(now)
  local nxt = tonumber(redis.call('HGET', K_PINS, 'next'))
  if not nxt or nxt > now then return 0 end
  local all = redis.call('HGETALL', K_PINS)
  local n, earliest = 0, nil
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if f:sub(1, 2) == 'p:' then
      local d = tonumber(v:match('^%S+'))
      if d <= now then
        redis.call('HDEL', K_PINS, f)
        undo(v)
        n = n + 1
      elseif not earliest or d < earliest then
        earliest = d
      end
    end
  end
  if earliest then redis.call('HSET', K_PINS, 'next', earliest) else redis.call('HDEL', K_PINS, 'next') end
  return n
end

-- The earliest deadline of a live pin (ms), or nil.
function PINS.next_deadline()
  return tonumber(redis.call('HGET', K_PINS, 'next'))
end
