--- @include "lib/pool"
--- What each tenant holds in the pool, for its quotas (K_HELD): "L:<lease>" -> "<tenant>
--- <blocks> <sequences>", "T:<tenant>" -> "<blocks> <sequences> <leases>" (the sums over
--- its leases that hold anything here). Blocks: one per block reference in the lease's
--- tables (a shared block counts in every table that holds it) plus its reserve.
--- Sequences: its sequences plus the sequence numbers granted to it and not used yet.
--- A script loads a lease's holdings (held_load), checks its growth against the quotas
--- (held_check / held_room) and writes the change (held_write); a lease reaped for good
--- leaves its tenant's sums (held_drop).

local function held_load(lease, tenant)
  local h = {lease = lease, tenant = tenant or '', lb = 0, ls = 0, tb = 0, ts = 0, tl = 0, known = false}
  local v = redis.call('HGET', K_HELD, 'L:' .. lease)
  if v then
    local t, b, s = string.match(v, '^(%S+) (%d+) (%d+)$')
    h.tenant, h.lb, h.ls, h.known = t, tonumber(b), tonumber(s), true
  end
  if h.tenant ~= '' then
    local tv = redis.call('HGET', K_HELD, 'T:' .. h.tenant)
    if tv then
      local b, s, l = string.match(tv, '^(%d+) (%d+) (%d+)$')
      h.tb, h.ts, h.tl = tonumber(b), tonumber(s), tonumber(l)
    end
  end
  return h
end

local QUOTA_NAMES = {blocks = 'blocks per pool', sequences = 'sequences per pool'}

-- What a quota (q.blocks, q.sequences; 0: none) leaves the lease's tenant to add beyond
-- its holdings and ``pending`` more (math.huge when none, or when the tenant is unknown).
local function held_room(h, which, q, pending)
  local limit = q[which] or 0
  if limit <= 0 or h.tenant == '' then return math.huge end
  local now = (which == 'blocks') and h.tb or h.ts
  return math.max(0, limit - now - (pending or 0))
end

-- Raises RESOURCE_EXHAUSTED (reason QUOTA_EXCEEDED) when adding db blocks or ds
-- sequences would take the tenant past a quota; only growth is checked.
local function held_check(h, db, ds, q, pool)
  for which, d in pairs({blocks = db, sequences = ds}) do
    if d > 0 and held_room(h, which, q) < d then
      local limit, now = q[which], (which == 'blocks') and h.tb or h.ts
      bad('RESOURCE_EXHAUSTED', 'tenant ' .. h.tenant .. ' holds ' .. now .. ' ' .. which .. ' in pool ' .. pool ..
        ' and asks ' .. d .. ' more: its quota of ' .. QUOTA_NAMES[which] .. ' is ' .. limit,
        {reason = 'QUOTA_EXCEEDED', quota = which, limit = limit, needed = d, available = math.max(0, limit - now)})
    end
  end
end

-- Adds db blocks and ds sequences (either may be < 0) to the lease's and its tenant's sums.
local function held_write(h, db, ds)
  if h.tenant == '' or (db == 0 and ds == 0 and h.known) then return end
  if not h.known then h.tl = h.tl + 1; h.known = true end
  h.lb, h.ls = math.max(0, h.lb + db), math.max(0, h.ls + ds)
  h.tb, h.ts = math.max(0, h.tb + db), math.max(0, h.ts + ds)
  redis.call('HSET', K_HELD, 'L:' .. h.lease, string.format('%s %d %d', h.tenant, h.lb, h.ls),
    'T:' .. h.tenant, string.format('%d %d %d', h.tb, h.ts, h.tl))
end

-- A lease that holds nothing here any more (reaped): it leaves its tenant's sums.
local function held_drop(lease)
  local h = held_load(lease)
  if not h.known then return end
  redis.call('HDEL', K_HELD, 'L:' .. lease)
  local tb, ts, tl = math.max(0, h.tb - h.lb), math.max(0, h.ts - h.ls), math.max(0, h.tl - 1)
  if tl == 0 then
    redis.call('HDEL', K_HELD, 'T:' .. h.tenant)
  else
    redis.call('HSET', K_HELD, 'T:' .. h.tenant, string.format('%d %d %d', tb, ts, tl))
  end
end
