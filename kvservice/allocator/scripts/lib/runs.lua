--- @include "lib/refs"
--- @include "lib/held"
--- @include "lib/reserve"
--- Runs: operations larger than one script call (DESIGN §14), carried out in bounded
--- parts on one sequence record (scripts/stage.lua; sync.lua for a journal's long fork
--- or free; reap.lua for a long sequence of an ended lease).
---
--- A record being built is *staged* (state "s", lib/records): its blocks are referenced
--- (hits pinned, new blocks taken) but it is no sequence yet; its run is K_STATE
--- "run:<n>" = "<lease> <admitted> <kind> <parent> <parent blocks>": the blocks the run
--- may still take beyond what the pool gives others (its admission), what it builds
--- (create, fork), and for a fork the parent's number and its table's length at the fork.
--- K_STATE "admitted" is the sum of the runs' admissions: lib/pool's available_now()
--- leaves them out, so that two large creates racing for room for one cannot both hold
--- half (the first admitted wins; the other is refused before it takes anything).
---
--- A record being freed is in state "f"; "d" for a staged create being discarded: its
--- blocks past the cached prefix lose the hashes its run registered (their content was
--- never computed). Either is released from its last block, a bounded part per call.

local function run_get(n)
  local v = redis.call('HGET', K_STATE, 'run:' .. n)
  if not v then return nil end
  local lease, left, kind, parent, pnb = string.match(v, '^(%S+) (%d+) (%a+) (%d+) (%d+)$')
  return {lease = lease, left = tonumber(left), kind = kind, parent = parent, pnb = tonumber(pnb)}
end

local function run_set(n, run)
  redis.call('HSET', K_STATE, 'run:' .. n,
    string.format('%s %d %s %s %d', run.lease, run.left, run.kind, run.parent or '0', run.pnb or 0))
end

-- Changes the pool's admitted blocks by d.
local function admit(d)
  if d ~= 0 then redis.call('HINCRBY', K_STATE, 'admitted', d) end
end

-- Ends a run: its admission goes back to the pool.
local function run_end(n, run)
  run = run or run_get(n)
  if not run then return end
  admit(-run.left)
  redis.call('HDEL', K_STATE, 'run:' .. n)
end

-- Drops the hashes that the blocks i0 .. nb of a discarded create hold (lib/records:
-- state "d"), where the hash still names that block.
local function unhash(rec, i0)
  local nb = rec.nb
  if i0 > nb then return end
  local blocks, fields = {}, {}
  for i = i0, nb do
    local b = rec_block(rec, i)
    blocks[#blocks + 1] = b; fields[#fields + 1] = D[b] or dec(b)
  end
  local hs = hmget_chunked(K_B2H, fields)
  local hashes, of = {}, {}
  for i, h in ipairs(hs) do
    if h then hashes[#hashes + 1] = h; of[#of + 1] = fields[i] end
  end
  if #hashes == 0 then return end
  local names = hmget_chunked(K_H2B, hashes)
  local gone = {}
  for i, h in ipairs(hashes) do
    if names[i] == of[i] then gone[#gone + 1] = h end
  end
  if #gone > 0 then call_chunked('HDEL', K_H2B, gone) end
  EVENTS.add('R', 'GPU', gone)
  call_chunked('HDEL', K_B2H, of)
end

-- Releases the last ``budget`` blocks (at least one) of a stored record, last block first,
-- and deletes the record once it holds none; the record is being freed (state "f" or "d",
-- begin_free) or dropped with its lease. A block that reaches 0 goes to the evictable set
-- if it has a hash, else to the free list, or, with ``to_reserve`` (a journal's free), a
-- partial block (past the record's full blocks) back to the lease's reserve. Writes
-- everything (the overlay included: it must hold nothing else). Returns the blocks
-- released and whether the record is gone.
local function release_tail(rec, budget, num_blocks, bs, to_reserve)
  local nb = rec.nb
  local m = math.min(math.max(budget, 1), nb)
  local first = nb - m + 1
  if rec.st == 'd' then unhash(rec, math.max(rec.k / bs + 1, first)) end
  local blocks = rec_blocks(rec, first, nb)
  load_refs(blocks)
  for i = #blocks, 1, -1 do decref(blocks[i]) end
  local back = 0
  if to_reserve then
    local full = math.floor(rec.t / bs)
    for i, b in ipairs(blocks) do
      if refs[b] == 0 and first + i - 1 > full then
        -- (a partial block that reaches 0 is the lease's alone: back to its reserve)
        refs[b] = nil; init[b] = nil
        redis.call('HDEL', K_REF, D[b] or dec(b))
        redis.call('HSET', K_RESERVE, D[b] or dec(b), rec.l)
        back = back + 1
      end
    end
    if back > 0 then
      local applied, reserved = lease_progress(rec.l)
      set_lease_progress(rec.l, applied, reserved + back)
    end
  end
  apply(num_blocks, zero_hashed(nil), {}, nil)
  local held = held_load(rec.l)
  held_write(held, back - m, 0)
  if m == nb then
    local del, del_tab = {}, {}
    drop_record(rec, del, del_tab)
    write_records({}, {}, del, del_tab, {}, {rec.l .. ':' .. rec.f})
    rec.nb = 0
    return m, true
  end
  local writes, dels = {}, {}
  rec_truncate(rec, nb - m, writes, dels)
  write_records({rec.f, meta_string(rec)}, writes, {}, dels, {}, {})
  return m, false
end

-- The next part of a fork's copy: the parent's blocks child.nb + 1 .. min(pnb, child.nb +
-- budget), each planned ref + 1 in the overlay (nothing written). Returns them.
local function plan_copy(child, parent, pnb, budget)
  local blocks = rec_blocks(parent, child.nb + 1, math.min(pnb, child.nb + budget))
  load_refs(blocks)
  for _, b in ipairs(blocks) do refs[b] = refs[b] + 1 end
  return blocks
end

-- Writes a planned copy: the overlay, the blocks appended to the child's pages, its meta
-- (as the child is now), and its lease's holdings.
local function write_copy(child, blocks, num_blocks, stats, held)
  apply(num_blocks, {}, stats, nil)
  child.add = blocks
  local put_tab = {}
  rec_page_writes(child, {}, put_tab)
  local nb = child.nb + #blocks
  write_records({child.f, meta_string(child)}, put_tab, {}, {}, {}, {})
  child.nb, child.add = nb, {}
  held_write(held, #blocks, 0)
end

-- Starts freeing a live or staged record: its state becomes "f" (a staged create's: "d"),
-- its run ends, it leaves the live count and its lease's sequences. (Writes the meta.)
local function begin_free(rec, stats)
  if rec.st == 'f' or rec.st == 'd' then return end
  local run = nil
  if rec.st == 's' then run = run_get(rec.f) end
  if run then run_end(rec.f, run) end
  if rec.st == '' then stats.sequences_freed = (stats.sequences_freed or 0) + 1 end
  rec.st = (run and run.kind == 'create') and 'd' or 'f'
  redis.call('HSET', K_SEQS, rec.f, meta_string(rec))
  held_write(held_load(rec.l), 0, -1)
end
