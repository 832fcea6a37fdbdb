--- @include "lib/pool"
--- @include "lib/chunked"
--- @include "lib/records"
--- @include "lib/tiers"
--- The reference-count overlay: a script plans its whole call in these tables, checks it,
--- and only then writes it with apply().
---
--- refs[b]: the planned count; init[b]: 'u' referenced, 'e' evictable, 'n' new (a negative
--- placeholder); zero: blocks whose count reached 0, in order; orig[b]: the count as
--- loaded; evl: the loaded blocks that were evictable (count 0).
local refs, init, zero, orig, evl = {}, {}, {}, {}, {}
local nplace = 0

local function load_refs(blocks)
  local want, fields = {}, {}
  for _, b in ipairs(blocks) do
    if refs[b] == nil then refs[b] = 0; want[#want + 1] = b; fields[#fields + 1] = D[b] or dec(b) end
  end
  if #want == 0 then return end
  local got = hmget_chunked(K_REF, fields)
  for i, b in ipairs(want) do
    local r = tonumber(got[i]) or 0
    refs[b] = r
    orig[b] = r
    if r > 0 then init[b] = 'u' else init[b] = 'e'; evl[#evl + 1] = b end
  end
end

local function placeholder()
  nplace = nplace + 1
  refs[-nplace] = 1
  init[-nplace] = 'n'
  return -nplace
end

local function decref(b)
  refs[b] = refs[b] - 1
  if refs[b] == 0 then zero[#zero + 1] = b end
end

-- Drops one sequence record's references, last block first (so that a chain's tail is
-- evicted before its head).
local function release(rec)
  for i = rec_len(rec), 1, -1 do decref(rec_block(rec, i)) end
end

-- How many blocks the plan makes available beyond the current free and evictable sets
-- (may be < 0): revived blocks leave the evictable set, blocks that reach 0 join.
-- (A referenced block reaches 0 only through decref, so it is in zero.)
local function net_released()
  local n = 0
  for _, b in ipairs(evl) do
    if refs[b] > 0 then n = n - 1 end
  end
  if #zero > 0 then
    local seen = {}
    for _, b in ipairs(zero) do
      if refs[b] == 0 and init[b] == 'u' and not seen[b] then seen[b] = true; n = n + 1 end
    end
  end
  return n
end

-- The blocks whose count the plan brought to 0 (each once), and their decimal ids.
local function zeroed()
  local blocks, fields, seen = {}, {}, {}
  for _, b in ipairs(zero) do
    if refs[b] == 0 and init[b] == 'u' and not seen[b] then
      seen[b] = true
      blocks[#blocks + 1] = b; fields[#fields + 1] = D[b] or dec(b)
    end
  end
  return blocks, fields
end

-- Which of the blocks the plan brings to 0 have a hash, or get one in this call
-- (by_block[b]): those go to the evictable set, the others to the free list.
local function zero_hashed(by_block)
  local blocks, fields = zeroed()
  local hashed = {}
  if #blocks > 0 then
    local hs = hmget_chunked(K_B2H, fields)
    for i, b in ipairs(blocks) do
      if hs[i] or (by_block and by_block[b]) then hashed[b] = true end
    end
  end
  return hashed
end

-- What a script's plan does to blocks, as lists of decimal ids (and values) to write in
-- one call each by write_changes(): counts to set or drop, reserve fields to drop or set
-- (block, lease), evictable blocks revived, and blocks that reached 0 (park()).
local function changes()
  return {set_ref = {}, del_ref = {}, unreserve = {}, reserve_add = {}, revive = {}, to_evict = {}, to_free = {},
          clock = nil}
end

-- A block (decimal id s) whose count reached 0: to the evictable set (LRU clock) if it
-- has a hash, else to the free list.
local function park(w, s, hashed)
  if hashed then
    if w.clock == nil then w.clock = tonumber(redis.call('HGET', K_STATE, 'clock')) or 0 end
    w.clock = w.clock + 1
    w.to_evict[#w.to_evict + 1] = w.clock; w.to_evict[#w.to_evict + 1] = s
  else
    w.to_free[#w.to_free + 1] = s
  end
end

local function write_changes(w)
  if w.clock ~= nil then redis.call('HSET', K_STATE, 'clock', w.clock) end
  if #w.revive > 0 then call_chunked('ZREM', K_EVICT, w.revive) end
  if #w.set_ref > 0 then call_chunked('HSET', K_REF, w.set_ref, 2) end
  if #w.del_ref > 0 then call_chunked('HDEL', K_REF, w.del_ref) end
  if #w.unreserve > 0 then call_chunked('HDEL', K_RESERVE, w.unreserve) end
  if #w.reserve_add > 0 then call_chunked('HSET', K_RESERVE, w.reserve_add, 2) end
  if #w.to_evict > 0 then call_chunked('ZADD', K_EVICT, w.to_evict, 2) end
  if #w.to_free > 0 then call_chunked('RPUSH', K_FREE, w.to_free) end
end

-- Registers hashes: h2b and b2h as lists of (hash, block id) and (block id, hash) pairs.
local function write_hashes(h2b, b2h)
  if #h2b > 0 then
    call_chunked('HSET', K_H2B, h2b, 2)
    call_chunked('HSET', K_B2H, b2h, 2)
    local hs = {}
    for i = 1, #h2b, 2 do hs[#hs + 1] = h2b[i] end
    EVENTS.add('S', 'GPU', hs)
  end
end

-- Evicts n blocks (least recently used first) for the plan's placeholders; returns them.
-- A victim whose hash leaves the device tier is copied down first (TIER.offload).
-- A victim's hash is dropped, unless dups[hash] names a block of this call that holds
-- the same content and stays referenced: then that block takes the hash (a hash never
-- disappears while its content is cached), and (hash, block) joins moved.
local function evict(n, dups, moved, stats)
  local popped = redis.call('ZPOPMIN', K_EVICT, n)
  local victims, fields = {}, {}
  for i = 1, #popped, 2 do
    local b = tonumber(popped[i])
    victims[#victims + 1] = b
    fields[#fields + 1] = D[b] or dec(b)
  end
  local hashes = hmget_chunked(K_B2H, fields)
  local gone = {}
  for i, h in ipairs(hashes) do
    if h then
      local keep = dups and dups[h]
      local r = keep and refs[keep]
      if keep and (r == nil or r > 0) then
        moved[#moved + 1] = {h, keep}
      else
        gone[#gone + 1] = h
        TIER.offload(victims[i], h, stats)     -- (its content goes down a tier: lib/tiers)
      end
    end
  end
  if #gone > 0 then call_chunked('HDEL', K_H2B, gone) end
  EVENTS.add('R', 'GPU', gone)
  call_chunked('HDEL', K_B2H, fields)
  stats.evictions = (stats.evictions or 0) + #victims
  return victims
end

-- Writes sequence records: field/value pairs of records and of table pages to set, record
-- fields and page fields to delete, lease-index members ("<lease>:<n>") to add (score 0)
-- and to remove.
local function write_records(put_meta, put_tab, del, del_tab, lseq_add, lseq_del)
  if #put_meta > 0 then call_chunked('HSET', K_SEQS, put_meta, 2) end
  if #put_tab > 0 then call_chunked('HSET', K_TABS, put_tab, 2) end
  if #del > 0 then call_chunked('HDEL', K_SEQS, del) end
  if #del_tab > 0 then call_chunked('HDEL', K_TABS, del_tab) end
  if #lseq_add > 0 then call_chunked('ZADD', K_LSEQ, lseq_add, 2) end
  if #lseq_del > 0 then call_chunked('ZREM', K_LSEQ, lseq_del) end
end

-- Appends to del / del_tab the record's field and its table's pages (a record deleted).
local function drop_record(rec, del, del_tab)
  del[#del + 1] = rec.f
  for _, pf in ipairs(page_fields(rec.f, rec.nb)) do del_tab[#del_tab + 1] = pf end
end

-- Takes n blocks for the caller: the free list first, then never-used blocks, then LRU
-- eviction (dups, moved: see evict()). Returns them (fewer if the pool has fewer).
local function take_blocks(n, num_blocks, dups, moved, stats)
  local got = {}
  local nfree = redis.call('LLEN', K_FREE)
  if nfree > 0 then
    for _, b in ipairs(redis.call('LPOP', K_FREE, math.min(n, nfree))) do got[#got + 1] = tonumber(b) end
  end
  if #got < n then
    local fresh = tonumber(redis.call('HGET', K_STATE, 'fresh')) or 0
    while #got < n and fresh < num_blocks do
      got[#got + 1] = fresh
      fresh = fresh + 1
    end
    redis.call('HSET', K_STATE, 'fresh', fresh)
  end
  if #got < n then
    for _, b in ipairs(evict(n - #got, dups, moved, stats)) do got[#got + 1] = b end
  end
  return got
end

-- Writes the overlay: revivals, blocks that reached 0 (to the evictable set if they have
-- a hash, else to the free list), then allocates nplace blocks (free list, never-used
-- blocks, then LRU eviction) and writes every planned count. hashed[b] says whether a
-- block has, or is about to get, a hash; dups: see evict(). Returns the map
-- placeholder -> block id.
local function apply(num_blocks, hashed, stats, dups)
  local revive, set_ref, del_ref = {}, {}, {}
  for b, r in pairs(refs) do
    if b >= 0 then
      if init[b] == 'e' and r > 0 then revive[#revive + 1] = D[b] or dec(b) end
      if r > 0 then
        if r ~= orig[b] then set_ref[#set_ref + 1] = D[b] or dec(b); set_ref[#set_ref + 1] = D[r] or dec(r) end
      elseif init[b] == 'u' then
        del_ref[#del_ref + 1] = D[b] or dec(b)
      end
    end
  end
  local w = changes()
  w.revive, w.del_ref = revive, del_ref
  local zero_blocks, zero_fields = zeroed()
  for i, b in ipairs(zero_blocks) do park(w, zero_fields[i], hashed[b]) end
  write_changes(w)
  local got, moved = {}, {}
  if nplace > 0 then
    got = take_blocks(nplace, num_blocks, dups, moved, stats)
    if #got < nplace then
      error('allocator invariant broken: planned ' .. nplace .. ' blocks, found ' .. #got)
    end
    for i = 1, nplace do
      local b, r = got[i], refs[-i]
      set_ref[#set_ref + 1] = D[b] or dec(b); set_ref[#set_ref + 1] = D[r] or dec(r)
    end
    stats.blocks_allocated = (stats.blocks_allocated or 0) + nplace
  end
  if #set_ref > 0 then call_chunked('HSET', K_REF, set_ref, 2) end
  local map = {}
  for i = 1, nplace do map[-i] = got[i] end
  if #moved > 0 then
    local h2b, b2h = {}, {}
    for _, m in ipairs(moved) do
      local h, b = m[1], m[2]
      if b < 0 then b = map[b] end
      local s = D[b] or dec(b)
      h2b[#h2b + 1] = h; h2b[#h2b + 1] = s
      b2h[#b2h + 1] = s; b2h[#b2h + 1] = h
    end
    write_hashes(h2b, b2h)
  end
  return map
end
