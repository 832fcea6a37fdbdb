"""The Lua scripts that are the only writers of allocator state.

Conventions (see ``kvservice.allocator.keys`` for the key layout):

- Pool scripts get the 13 pool keys as ``KEYS[1..13]`` and, where they are idempotent,
  the request key as ``KEYS[14]``; lease scripts get the lease's two keys.
- ``ARGV[1]`` is a JSON payload (the step script takes its items as lines of text in
  ARGV[2..3], cheaper to pass and read than JSON); every script returns a JSON string: the result, or
  ``{"err": <gRPC code name>, "msg": ..., ...}``. Python turns error codes into
  ``kvservice.errors`` exceptions.
- Validate first, write after: a script plans the whole call in Lua tables (reference
  counts in an overlay, new blocks as negative placeholders), raises a table through
  ``bad()`` on the first problem, and only then writes. An error leaves no trace.
- Time is Redis ``TIME`` in milliseconds. Work per call is capped by the caller's
  limits (items, blocks), which the scripts check again.
"""

from __future__ import annotations

# Shared helpers, prepended to every pool script.
LIB = r"""
local K_META, K_STATE, K_FREE, K_EVICT, K_REF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_H2B, K_B2H, K_SEQS, K_LEASES, K_LSEQ = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_DEAD, K_STATS, K_TABS = KEYS[11], KEYS[12], KEYS[13]
local CHUNK = 4000
local W = 6   -- hex digits per block id in a stored block table

-- Block ids and counts as Redis arguments: Redis would format each number argument
-- itself (slowly); D caches the decimal string of a number, made once per call.
local D = {}
local function dec(n)
  local s = string.format('%d', n)
  D[n] = s
  return s
end

local function bad(code, msg, extra)
  error({code = code, msg = msg, extra = extra}, 0)
end

local function fail_reply(e)
  local t = e.extra or {}
  t.err = e.code
  t.msg = e.msg
  return cjson.encode(t)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Calls a variadic command over a long argument list in chunks (Lua's stack is small).
local function call_chunked(cmd, key, args, step)
  step = step or 1
  local n = #args
  local per = CHUNK - (CHUNK % step)
  local i = 1
  while i <= n do
    local j = math.min(i + per - 1, n)
    redis.call(cmd, key, unpack(args, i, j))
    i = j + 1
  end
end

local function hmget_chunked(key, fields)
  local n = #fields
  if n > 0 and n <= CHUNK then return redis.call('HMGET', key, unpack(fields)) end
  local out = {}
  local i = 1
  while i <= n do
    local j = math.min(i + CHUNK - 1, n)
    local got = redis.call('HMGET', key, unpack(fields, i, j))
    for k = 1, #got do out[i + k - 1] = got[k] end
    i = j + 1
  end
  return out
end

-- Idempotency: returns the stored outcome of a request id, or nil.
local function replay(p)
  if p.rid == nil or p.rid == '' then return nil end
  local prev = redis.call('GET', KEYS[14])
  if not prev then return nil end
  local cut = string.find(prev, '\n', 1, true)
  if string.sub(prev, 1, cut - 1) ~= p.digest then
    return cjson.encode({err = 'INVALID_ARGUMENT',
      msg = 'request_id ' .. p.rid .. ' was already used with different arguments'})
  end
  return string.sub(prev, cut + 1)
end

local function remember(p, out)
  if p.rid ~= nil and p.rid ~= '' then
    redis.call('SET', KEYS[14], p.digest .. '\n' .. out, 'PX', p.req_ttl_ms)
  end
  return out
end

local function pool_meta(pool_id)
  local m = redis.call('HMGET', K_META, 'epoch', 'num_blocks', 'block_size')
  if not m[1] then bad('NOT_FOUND', 'pool ' .. pool_id .. ' is not registered') end
  return tonumber(m[1]), tonumber(m[2]), tonumber(m[3])
end

-- Reference-count overlay. refs[b]: planned count; init[b]: 'u' referenced, 'e' evictable,
-- 'n' new (negative placeholder). zero: blocks whose count reached 0, in order.
-- orig[b]: the count as loaded; evl: the loaded blocks that were evictable (count 0).
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

-- Sequence records: ``seqs`` holds "<lease> <num_tokens> <committed> <cached> <last hash>",
-- ``tabs`` the block table as W hex digits per block. A loaded record is read lazily:
-- rec.tab / rec.nb as stored, rec.cowlast replacing its last block, rec.add appended.
local function load_rec(meta, tab)
  local l, t, c, k, h = string.match(meta, '^(%S+) (%d+) (%d+) (%d+) (%x+)$')
  tab = tab or ''
  -- (lastb: the stored last block once read; a slot made here costs less than a rehash later)
  return {l = l, t = tonumber(t), c = tonumber(c), k = tonumber(k), h = h, tab = tab, nb = #tab / W, add = {},
          lastb = false}
end

local function meta_string(rec)
  return rec.l .. ' ' .. rec.t .. ' ' .. rec.c .. ' ' .. rec.k .. ' ' .. rec.h
end

local function hexid(b)
  return string.format('%06x', b)
end

-- The W-digit hex ids of a list of blocks, concatenated (placeholders resolved through map).
local function hexids(list, map)
  local n = #list
  if n == 0 then return '' end
  local ids = list
  if map then
    ids = {}
    for i = 1, n do local b = list[i]; ids[i] = map[b] or b end
  end
  if n == 1 then return string.format('%06x', ids[1]) end
  local parts = {}
  local i = 1
  while i <= n do
    local j = math.min(i + 499, n)
    parts[#parts + 1] = string.format(string.rep('%06x', j - i + 1), unpack(ids, i, j))
    i = j + 1
  end
  return table.concat(parts)
end

local function rec_len(rec)
  return rec.nb + #rec.add
end

local function rec_block(rec, i)
  if i > rec.nb then return rec.add[i - rec.nb] end
  if i == rec.nb and rec.cowlast then return rec.cowlast end
  return tonumber(string.sub(rec.tab, i * W - W + 1, i * W), 16)
end

local function rec_blocks(rec)
  local out = {}
  for i = 1, rec_len(rec) do out[i] = rec_block(rec, i) end
  return out
end

-- The table to store, placeholders resolved through map; and the appended blocks' part.
local function rec_tab(rec, map)
  local tab = rec.tab
  if rec.cowlast then
    tab = string.sub(tab, 1, (rec.nb - 1) * W) .. hexid(map[rec.cowlast] or rec.cowlast)
  end
  if #rec.add == 0 then return tab, '' end
  local added = hexids(rec.add, map)
  return tab .. added, added
end

-- Drops one sequence record's references, last block first (so that a chain's tail is
-- evicted before its head).
local function release(rec)
  for i = rec_len(rec), 1, -1 do decref(rec_block(rec, i)) end
end

-- Blocks that leave the evictable set or reach 0 do so here; returns how many blocks
-- the plan makes available beyond the current free and evictable sets (may be < 0).
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

local function available_now(num_blocks)
  local st = redis.call('HMGET', K_STATE, 'fresh')
  local fresh = tonumber(st[1]) or 0
  return redis.call('LLEN', K_FREE) + (num_blocks - fresh) + redis.call('ZCARD', K_EVICT)
end

local function incr_stats(stats)
  for k, v in pairs(stats) do
    if v ~= 0 then redis.call('HINCRBY', K_STATS, k, v) end
  end
end

-- Writes the overlay: revivals, blocks that reached 0 (to the evictable set if they have
-- a hash, else to the free list), then allocates nplace blocks (free list, never-used
-- blocks, then LRU eviction) and writes every planned count. has_hash(b) says whether a
-- block has, or is about to get, a hash. Returns the map placeholder -> block id.
local function apply(num_blocks, has_hash, stats)
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
  if #revive > 0 then call_chunked('ZREM', K_EVICT, revive) end
  if #del_ref > 0 then call_chunked('HDEL', K_REF, del_ref) end
  local to_free, to_evict, done = {}, {}, {}
  local clock = nil
  for _, b in ipairs(zero) do
    if refs[b] == 0 and init[b] == 'u' and not done[b] then
      done[b] = true
      if has_hash(b) then
        if clock == nil then clock = tonumber(redis.call('HGET', K_STATE, 'clock')) or 0 end
        clock = clock + 1
        to_evict[#to_evict + 1] = clock; to_evict[#to_evict + 1] = D[b] or dec(b)
      else
        to_free[#to_free + 1] = D[b] or dec(b)
      end
    end
  end
  if clock ~= nil then redis.call('HSET', K_STATE, 'clock', clock) end
  if #to_evict > 0 then call_chunked('ZADD', K_EVICT, to_evict, 2) end
  if #to_free > 0 then call_chunked('RPUSH', K_FREE, to_free) end
  local got = {}
  if nplace > 0 then
    local nfree = redis.call('LLEN', K_FREE)
    if nfree > 0 then
      local popped = redis.call('LPOP', K_FREE, math.min(nplace, nfree))
      for _, b in ipairs(popped) do got[#got + 1] = tonumber(b) end
    end
    if #got < nplace then
      local fresh = tonumber(redis.call('HGET', K_STATE, 'fresh')) or 0
      while #got < nplace and fresh < num_blocks do
        got[#got + 1] = fresh
        fresh = fresh + 1
      end
      redis.call('HSET', K_STATE, 'fresh', fresh)
    end
    if #got < nplace then
      local popped = redis.call('ZPOPMIN', K_EVICT, nplace - #got)
      local victims = {}
      for i = 1, #popped, 2 do
        local b = tonumber(popped[i])
        got[#got + 1] = b
        victims[#victims + 1] = D[b] or dec(b)
      end
      local hashes = hmget_chunked(K_B2H, victims)
      local hs = {}
      for _, h in ipairs(hashes) do if h then hs[#hs + 1] = h end end
      if #hs > 0 then call_chunked('HDEL', K_H2B, hs) end
      call_chunked('HDEL', K_B2H, victims)
      stats.evictions = (stats.evictions or 0) + #victims
    end
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
  return map
end

local function resolve(map, list)
  for i, b in ipairs(list) do
    if b < 0 then list[i] = map[b] end
  end
  return list
end
"""

# One engine step in one pool: commits, frees, forks, growth (with copy-on-write), creates.
STEP = LIB + r"""
-- KEYS[1..13]: pool keys; KEYS[14]: request key.
-- ARGV[1]: JSON {pool, rid, digest, req_ttl_ms, lease, lease_deadline, max_blocks}
-- ARGV[2]: the updates, one line each: "<seq number> <epoch> <num_tokens (-1: the
--   allocator's)> <grow_to> <free 1|0> <first commit index> <parent hash hex|-> <fork grow_to
--   values, comma separated|-> <commit hashes, 32 hex digits each, concatenated|->".
-- ARGV[3]: the creates, one line each: "<epoch> <prompt length> <root hash> <full-block
--   hashes concatenated|->". (Few long arguments: each argument costs a few microseconds.)
-- Returns JSON {epoch, updates = [{t, c, h, nb, cow, freed, kids}], created = [rec],
--   copies = [[src, dst]]} (tables as 6-hex-digit strings), or an error.
local p = cjson.decode(ARGV[1])
local prev = replay(p)
if prev then return prev end

local function split_hashes(s)
  local out = {}
  if s == '-' then return out end
  for j = 1, #s / 32 do out[j] = string.sub(s, j * 32 - 31, j * 32) end
  return out
end

-- An update keeps its commit hashes as one string (u.cms, u.ncm of them); hash j of u:
local function cm_hash(u, j)
  if u.ncm == 1 and #u.cms == 32 then return u.cms end
  return string.sub(u.cms, j * 32 - 31, j * 32)
end

local NOFORK = {}   -- shared by updates without forks (never written)
local function new_update(s, e, t, g, free, ci, ph, fks, cms)
  local fk = NOFORK
  if fks ~= '-' then
    fk = {}
    for x in string.gmatch(fks, '%d+') do fk[#fk + 1] = tonumber(x) end
  end
  if ph == '-' then ph = '' end
  return {s = s, e = tonumber(e), t = tonumber(t), g = tonumber(g), free = free == '1',
          ci = tonumber(ci), ph = ph, fk = fk, cms = cms, ncm = math.floor(#cms / 32)}
end

local UPDATE_LINE = '(%d+) (%d+) (%-?%d+) (%d+) ([01]) (%d+) (%S+) (%S+) (%S+)'
local ups, creates = {}, {}
-- Fast path: every line well formed and '\n'-separated, read in one pass; anything else
-- (a malformed or empty line) is read again line by line.
local fast = false
if ARGV[2] ~= '' then
  local text = ARGV[2] .. '\n'
  local pos = 1
  for at, s, e, t, g, free, ci, ph, fks, cms, nx in string.gmatch(text, '()' .. UPDATE_LINE .. '\n()') do
    if at ~= pos then break end
    ups[#ups + 1] = new_update(s, e, t, g, free, ci, ph, fks, cms)
    pos = nx
  end
  fast = pos == #text + 1
end
if not fast then
  ups = {}
  for line in string.gmatch(ARGV[2], '[^\n]+') do
    local s, e, t, g, free, ci, ph, fks, cms = string.match(line, '^' .. UPDATE_LINE .. '$')
    if not s then return cjson.encode({err = 'INVALID_ARGUMENT', msg = 'malformed update: ' .. line}) end
    ups[#ups + 1] = new_update(s, e, t, g, free, ci, ph, fks, cms)
  end
end
-- Lines split with plain finds, and the long last field checked for whitespace the same
-- way ('^(%d+) (%d+) (%x+) (%S+)$' costs per character).
do
  local text, pos = ARGV[3], 1
  local len = #text
  while pos <= len do
    local nl = string.find(text, '\n', pos, true) or len + 1
    if nl > pos then
      local line = string.sub(text, pos, nl - 1)
      local e, n, root, at = string.match(line, '^(%d+) (%d+) (%x+) ()')
      local hs
      if e then
        hs = string.sub(line, at)
        if hs == '' or string.find(hs, ' ', 1, true) or string.find(hs, '\t', 1, true) or
            string.find(hs, '\r', 1, true) or string.find(hs, '\v', 1, true) or string.find(hs, '\f', 1, true) then
          e = nil
        end
      end
      if not e then return cjson.encode({err = 'INVALID_ARGUMENT', msg = 'malformed create: ' .. line}) end
      creates[#creates + 1] = {e = tonumber(e), n = tonumber(n), root = root, hs = split_hashes(hs)}
    end
    pos = nl + 1
  end
end

local function sid_of(u)
  return p.pool .. '/' .. u.e .. '/' .. u.s
end

local ok, plan = pcall(function()
  local epoch, num_blocks, bs = pool_meta(p.pool)
  local now = now_ms()
  for _, u in ipairs(ups) do
    if u.e ~= epoch then
      bad('FAILED_PRECONDITION', 'sequence ' .. sid_of(u) ..
        ' belongs to epoch ' .. u.e .. ' but pool ' .. p.pool .. ' was re-registered (epoch ' .. epoch .. ')')
    end
  end
  for _, c in ipairs(creates) do
    if c.e ~= epoch then bad('STALE_EPOCH', 'pool ' .. p.pool .. ' is at epoch ' .. epoch, {epoch = epoch}) end
  end

  -- The lease must be live here, or (for creates) live in its own record.
  local dl = tonumber(redis.call('ZSCORE', K_LEASES, p.lease))
  local attach = false
  if not (dl and dl > now) then
    if dl or redis.call('ZSCORE', K_DEAD, p.lease) then
      bad('FAILED_PRECONDITION', 'lease ' .. p.lease .. ' has expired or was revoked; its sequences were freed')
    end
    if #creates > 0 then
      if p.lease_deadline == 0 then bad('LEASE_UNKNOWN', 'lease ' .. p.lease .. ' is not attached to ' .. p.pool) end
      if not (p.lease_deadline > now) then
        bad('FAILED_PRECONDITION', 'lease ' .. p.lease .. ' has expired')
      end
      attach = true
    end
  end

  -- Load every named sequence.
  local recs = {}
  if #ups > 0 then
    local fields = {}
    for i, u in ipairs(ups) do fields[i] = u.s end
    local metas = hmget_chunked(K_SEQS, fields)
    local tabs = hmget_chunked(K_TABS, fields)
    local lease = p.lease
    for i, u in ipairs(ups) do
      if not metas[i] then bad('NOT_FOUND', 'sequence ' .. sid_of(u) .. ' not found') end
      local rec = load_rec(metas[i], tabs[i])
      if rec.l ~= lease then bad('PERMISSION_DENIED', 'sequence ' .. sid_of(u) .. ' belongs to another lease') end
      if u.t < 0 then u.t = rec.t end
      if u.t < rec.t then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': num_tokens ' .. u.t ..
          ' is below the allocator\'s ' .. rec.t)
      end
      if u.t > rec.nb * bs then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': num_tokens ' .. u.t ..
          ' exceeds its block table (' .. rec.nb .. ' blocks of ' .. bs .. ')')
      end
      recs[i] = rec
    end
  end

  -- Reference counts: every block of freed and forked sequences, the last block of the rest.
  -- rec.lastb: the stored table's last block (read once).
  local want = {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    if u.free or #u.fk > 0 then
      rec.blocks = rec_blocks(rec)
      for _, b in ipairs(rec.blocks) do want[#want + 1] = b end
      if rec.nb > 0 then rec.lastb = rec.blocks[rec.nb] end
    elseif rec.nb > 0 then
      local b = rec_block(rec, rec.nb)
      rec.lastb = b
      want[#want + 1] = b
    end
  end
  load_refs(want)

  -- Phase 1: sync lengths and commit full blocks.
  local commit_hashes, commit_blocks = {}, {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    if u.t > rec.t and rec.t % bs ~= 0 and refs[rec.lastb or rec_block(rec, rec.nb)] > 1 then
      bad('FAILED_PRECONDITION', 'sequence ' .. sid_of(u) .. ': tokens were appended into its shared last block without a step')
    end
    rec.t = u.t
    local ncm = u.ncm
    if ncm > 0 then
      if u.ci ~= rec.c then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': commit starts at block ' .. u.ci ..
          ' but ' .. rec.c .. ' blocks are committed')
      end
      if u.ph ~= rec.h then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': parent_hash does not match its last committed block')
      end
      local last = u.ci + ncm
      if last * bs > u.t then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': block ' .. (last - 1) ..
          ' is not full at num_tokens ' .. u.t)
      end
      local h
      for j = 1, ncm do
        h = cm_hash(u, j)
        commit_hashes[#commit_hashes + 1] = h
        local idx = u.ci + j
        if idx == rec.nb and rec.lastb then
          commit_blocks[#commit_blocks + 1] = rec.lastb
        else
          commit_blocks[#commit_blocks + 1] = rec_block(rec, idx)
        end
      end
      rec.c = last
      rec.h = h
    end
  end

  -- Which hashes are cached already (commits and prompts), and which blocks have one.
  local lookup = commit_hashes
  if #creates > 0 then
    lookup = {}
    for _, h in ipairs(commit_hashes) do lookup[#lookup + 1] = h end
    for _, c in ipairs(creates) do
      for _, h in ipairs(c.hs) do lookup[#lookup + 1] = h end
    end
  end
  local known = {}
  if #lookup > 0 then
    local got = hmget_chunked(K_H2B, lookup)
    for i, h in ipairs(lookup) do
      if got[i] then known[h] = tonumber(got[i]) else known[h] = false end
    end
  end
  -- hash -> block, and the hashes and blocks to write
  local pending, reg_hs, reg_bs = {}, {}, {}
  if #commit_blocks > 0 then
    local fields = {}
    for j, b in ipairs(commit_blocks) do fields[j] = D[b] or dec(b) end
    local cur = hmget_chunked(K_B2H, fields)
    for j, h in ipairs(commit_hashes) do
      local b = commit_blocks[j]
      if not known[h] and not pending[h] and not cur[j] then
        pending[h] = b
        reg_hs[#reg_hs + 1] = h; reg_bs[#reg_bs + 1] = b
      end
    end
  end

  -- Phase 2: frees.
  local freed = {}
  for i, u in ipairs(ups) do
    if u.free then
      if #u.fk > 0 or u.g > 0 then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ' cannot be freed and forked or grown in one step')
      end
      release(recs[i])
      freed[#freed + 1] = i
    end
  end

  -- Checked before placeholders are made: a grow_to near 2^31 would otherwise plan
  -- millions of blocks (and hold Redis for seconds) before the limit is seen.
  local function need_blocks(n)
    if nplace + n > p.max_blocks then
      bad('INVALID_ARGUMENT', 'the step needs at least ' .. (nplace + n) .. ' new blocks; at most ' ..
        p.max_blocks .. ' per call')
    end
  end

  local copies = {}
  local function grow(rec, g)
    if g <= rec.t then return nil end
    local nb = rec_len(rec)
    local last
    if nb == rec.nb and rec.lastb and not rec.cowlast then last = rec.lastb else last = rec_block(rec, nb) end
    local shared_tail = rec.t % bs ~= 0 and refs[last] > 1
    local more = math.ceil(g / bs) - nb
    need_blocks(more + (shared_tail and 1 or 0))
    local cow = nil
    if shared_tail then
      local dst = placeholder()
      refs[last] = refs[last] - 1
      rec.cowlast = dst
      cow = {last, dst}
      copies[#copies + 1] = cow
    end
    local add = rec.add
    for _ = 1, more do
      add[#add + 1] = placeholder()
    end
    rec.t = g
    return cow
  end

  -- Phase 3: forks (children share every block, then grow).
  local kids = {}
  for i, u in ipairs(ups) do
    if #u.fk > 0 then
      local rec = recs[i]
      kids[i] = {}
      for _, g in ipairs(u.fk) do
        local child = {l = rec.l, t = rec.t, c = rec.c, h = rec.h, k = rec.k, tab = rec.tab, nb = rec.nb, add = {},
                       lastb = rec.lastb}
        for _, b in ipairs(rec.blocks) do refs[b] = refs[b] + 1 end
        if g > 0 and g < rec.t then
          bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': fork_grow_to ' .. g .. ' is below num_tokens ' .. rec.t)
        end
        child.cow = grow(child, g)
        kids[i][#kids[i] + 1] = child
      end
    end
  end

  -- Phase 4: growth.
  local cows = {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    local g = u.g
    if g > 0 and g < rec.t then
      bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': grow_to ' .. g .. ' is below num_tokens ' .. rec.t)
    end
    if g > rec.t then cows[i] = grow(rec, g) or false end
  end

  -- Phase 5: creates (longest cached prefix, never covering the last prompt token).
  local made = {}
  local queried, hit = 0, 0
  for _, c in ipairs(creates) do
    local max_hit = math.floor((c.n - 1) / bs)
    local rec = {l = p.lease, t = c.n, c = #c.hs, h = c.root, k = 0, tab = '', nb = 0, add = {}}
    if #c.hs > 0 then rec.h = c.hs[#c.hs] end
    local hits = {}
    for i = 1, math.min(max_hit, #c.hs) do
      local b = pending[c.hs[i]] or known[c.hs[i]]
      if not b then break end
      hits[i] = b
    end
    load_refs(hits)
    local add = rec.add
    for i, b in ipairs(hits) do
      refs[b] = refs[b] + 1
      add[i] = b
    end
    local total = math.ceil(c.n / bs)
    need_blocks(total - #hits)
    for i = #hits + 1, total do
      local b = placeholder()
      add[i] = b
      local h = c.hs[i]
      if h and not known[h] and not pending[h] then
        pending[h] = b
        reg_hs[#reg_hs + 1] = h; reg_bs[#reg_bs + 1] = b
      end
    end
    rec.k = #hits * bs
    queried = queried + c.n
    hit = hit + rec.k
    made[#made + 1] = rec
  end

  local available = available_now(num_blocks) + net_released()
  if nplace > available then
    bad('RESOURCE_EXHAUSTED', 'pool ' .. p.pool .. ': needed ' .. nplace .. ' blocks, ' .. available .. ' available',
      {needed = nplace, available = available})
  end
  return {epoch = epoch, num_blocks = num_blocks, recs = recs, kids = kids, cows = cows, made = made,
          freed = freed, reg_hs = reg_hs, reg_bs = reg_bs, copies = copies, attach = attach,
          queried = queried, hit = hit}
end)
if not ok then
  if type(plan) == 'table' then return fail_reply(plan) end
  error(plan)
end

-- Write phase.
local stats = {cow_copies = #plan.copies, prefix_queried_tokens = plan.queried,
               prefix_hit_tokens = plan.hit}
-- Hashes of real blocks first, so that a block committed and freed in one step is cached.
local reg_hs, reg_bs = plan.reg_hs, plan.reg_bs
local reg_h2b, reg_b2h, by_block = {}, {}, {}
for k = 1, #reg_hs do
  local b = reg_bs[k]
  if b >= 0 then
    local h, bs = reg_hs[k], D[b] or dec(b)
    reg_h2b[#reg_h2b + 1] = h; reg_h2b[#reg_h2b + 1] = bs
    reg_b2h[#reg_b2h + 1] = bs; reg_b2h[#reg_b2h + 1] = h
    by_block[b] = true
  end
end
local zero_blocks = {}
local zero_fields = {}
for _, b in ipairs(zero) do
  if refs[b] == 0 and init[b] == 'u' then
    zero_blocks[#zero_blocks + 1] = b; zero_fields[#zero_fields + 1] = D[b] or dec(b)
  end
end
local hashed = {}
if #zero_blocks > 0 then
  local zero_hashes = hmget_chunked(K_B2H, zero_fields)
  for i, b in ipairs(zero_blocks) do if zero_hashes[i] or by_block[b] then hashed[b] = true end end
end
if #reg_h2b > 0 then
  call_chunked('HSET', K_H2B, reg_h2b, 2)
  call_chunked('HSET', K_B2H, reg_b2h, 2)
end
local map = apply(plan.num_blocks, function(b) return hashed[b] == true end, stats)
reg_h2b, reg_b2h = {}, {}
for k = 1, #reg_hs do
  local b = reg_bs[k]
  if b < 0 then
    local h = reg_hs[k]
    b = map[b]
    local bs = D[b] or dec(b)
    reg_h2b[#reg_h2b + 1] = h; reg_h2b[#reg_h2b + 1] = bs
    reg_b2h[#reg_b2h + 1] = bs; reg_b2h[#reg_b2h + 1] = h
  end
end
if #reg_h2b > 0 then
  call_chunked('HSET', K_H2B, reg_h2b, 2)
  call_chunked('HSET', K_B2H, reg_b2h, 2)
end

-- Sequence records. The updates' part of the reply is written as JSON text here (the
-- same values cjson would give; a hash from ARGV[2] goes through cjson unless it is hex).
local nkids, nmade = 0, #plan.made
for _, ks in pairs(plan.kids) do nkids = nkids + #ks end
local next_n = 0
if nkids + nmade > 0 then next_n = redis.call('HINCRBY', K_META, 'next_seq', nkids + nmade) - nkids - nmade end
local put_meta, put_tab, lseq_add = {}, {}, {}
local function store(n, rec)
  local tab, added = rec_tab(rec, map)
  put_meta[#put_meta + 1] = n; put_meta[#put_meta + 1] = meta_string(rec)
  put_tab[#put_tab + 1] = n; put_tab[#put_tab + 1] = tab
  return tab, added
end
local function resolved(pair)
  if not pair then return nil end
  return {pair[1], map[pair[2]] or pair[2]}
end
local out_updates = {}
local is_freed = {}
for _, i in ipairs(plan.freed) do is_freed[i] = true end
local del, lseq_del = {}, {}
local lease = p.lease
for i, u in ipairs(ups) do
  local rec = plan.recs[i]
  local kids_json = '{}'
  local ks = plan.kids[i]
  if ks then
    local okids = {}
    for _, child in ipairs(ks) do
      next_n = next_n + 1
      local tab = store(next_n, child)
      lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. next_n
      okids[#okids + 1] = {n = next_n, t = child.t, c = child.c, h = child.h, k = child.k, b = tab,
                           cow = resolved(child.cow)}
    end
    if #okids > 0 then kids_json = cjson.encode(okids) end
  end
  local hj
  if u.ncm == 0 or string.find(rec.h, '^%x+$') then hj = '"' .. rec.h .. '"' else hj = cjson.encode(rec.h) end
  if is_freed[i] then
    del[#del + 1] = u.s
    lseq_del[#lseq_del + 1] = lease .. ':' .. u.s
    out_updates[i] = '{"t":' .. rec.t .. ',"c":' .. rec.c .. ',"h":' .. hj .. ',"kids":' .. kids_json ..
      ',"freed":true}'
  else
    local ts, cs = rec.t .. '', rec.c .. ''   -- meta_string's and the reply's, formatted once
    put_meta[#put_meta + 1] = u.s
    put_meta[#put_meta + 1] = rec.l .. ' ' .. ts .. ' ' .. cs .. ' ' .. rec.k .. ' ' .. rec.h
    local added = ''
    if #rec.add > 0 or rec.cowlast then
      local tab
      tab, added = rec_tab(rec, map)
      put_tab[#put_tab + 1] = u.s; put_tab[#put_tab + 1] = tab
    end
    local cow = plan.cows[i]
    local cow_json = ''
    if cow then cow_json = ',"cow":[' .. cow[1] .. ',' .. (map[cow[2]] or cow[2]) .. ']' end
    out_updates[i] = '{"t":' .. ts .. ',"c":' .. cs .. ',"h":' .. hj .. ',"kids":' .. kids_json ..
      ',"nb":"' .. added .. '"' .. cow_json .. '}'
  end
end
local out_made = {}
for _, rec in ipairs(plan.made) do
  next_n = next_n + 1
  local tab = store(next_n, rec)
  lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. next_n
  out_made[#out_made + 1] = {n = next_n, t = rec.t, c = rec.c, h = rec.h, k = rec.k, b = tab}
end
if #put_meta > 0 then call_chunked('HSET', K_SEQS, put_meta, 2) end
if #put_tab > 0 then call_chunked('HSET', K_TABS, put_tab, 2) end
if #del > 0 then
  call_chunked('HDEL', K_SEQS, del)
  call_chunked('HDEL', K_TABS, del)
end
if #lseq_add > 0 then call_chunked('ZADD', K_LSEQ, lseq_add, 2) end
if #lseq_del > 0 then call_chunked('ZREM', K_LSEQ, lseq_del) end
if plan.attach then redis.call('ZADD', K_LEASES, 'GT', p.lease_deadline, p.lease) end
local copies = {}
for _, cp in ipairs(plan.copies) do copies[#copies + 1] = resolved(cp) end
stats.sequences_created = nkids + nmade
stats.sequences_freed = #del
incr_stats(stats)
local updates_json = '{}'
if #out_updates > 0 then updates_json = '[' .. table.concat(out_updates, ',') .. ']' end
return remember(p, '{"epoch":' .. plan.epoch .. ',"updates":' .. updates_json .. ',"created":' ..
  cjson.encode(out_made) .. ',"copies":' .. cjson.encode(copies) .. '}')
"""

# Frees the sequences of expired (or one revoked) leases, a bounded number per call.
REAP = LIB + r"""
-- KEYS[1..13]: pool keys.
-- ARGV[1]: JSON {pool, force_lease ('' or a lease id to expire now), max_leases, max_seqs,
--   tombstone_ms}
-- Returns JSON {leases = expired leases fully reaped, seqs = sequences freed, more = bool}.
local p = cjson.decode(ARGV[1])
if redis.call('EXISTS', K_META) == 0 then
  return cjson.encode({err = 'NOT_FOUND', msg = 'pool ' .. p.pool .. ' is not registered'})
end
local epoch, num_blocks = tonumber(redis.call('HGET', K_META, 'epoch')), tonumber(redis.call('HGET', K_META, 'num_blocks'))
local now = now_ms()
if p.force_lease ~= '' and redis.call('ZSCORE', K_LEASES, p.force_lease) then
  redis.call('ZADD', K_LEASES, 0, p.force_lease)
end
local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, p.max_leases)
local budget = p.max_seqs
local nseqs, nleases, more = 0, 0, false
local del, lseq_del = {}, {}
for _, lease in ipairs(expired) do
  if budget <= 0 then more = true; break end
  local members = redis.call('ZRANGEBYLEX', K_LSEQ, '[' .. lease .. ':', '(' .. lease .. ';', 'LIMIT', 0, budget + 1)
  local take = math.min(#members, budget)
  if take > 0 then
    local ns = {}
    for i = 1, take do
      ns[i] = string.sub(members[i], #lease + 2)
      lseq_del[#lseq_del + 1] = members[i]
    end
    local metas = hmget_chunked(K_SEQS, ns)
    local tabs = hmget_chunked(K_TABS, ns)
    local recs = {}
    local blocks = {}
    for i = 1, take do
      if metas[i] then
        local rec = load_rec(metas[i], tabs[i])
        recs[#recs + 1] = rec
        for _, b in ipairs(rec_blocks(rec)) do blocks[#blocks + 1] = b end
        del[#del + 1] = ns[i]
      end
    end
    load_refs(blocks)
    for _, rec in ipairs(recs) do release(rec) end
    nseqs = nseqs + #recs
    budget = budget - take
  end
  if #members > take then
    more = true
  else
    redis.call('ZREM', K_LEASES, lease)
    redis.call('ZADD', K_DEAD, now, lease)
    nleases = nleases + 1
  end
end
if #expired == p.max_leases then more = true end
if #del > 0 then
  call_chunked('HDEL', K_SEQS, del)
  call_chunked('HDEL', K_TABS, del)
end
if #lseq_del > 0 then call_chunked('ZREM', K_LSEQ, lseq_del) end
local zero_blocks = {}
for _, b in ipairs(zero) do if refs[b] == 0 then zero_blocks[#zero_blocks + 1] = b end end
local hashed = {}
if #zero_blocks > 0 then
  local hs = hmget_chunked(K_B2H, zero_blocks)
  for i, b in ipairs(zero_blocks) do if hs[i] then hashed[b] = true end end
end
local stats = {leases_expired = nleases, sequences_reaped = nseqs, sequences_freed = nseqs}
apply(num_blocks, function(b) return hashed[b] == true end, stats)
redis.call('ZREMRANGEBYSCORE', K_DEAD, '-inf', now - p.tombstone_ms)
incr_stats(stats)
return cjson.encode({leases = nleases, seqs = nseqs, more = more, epoch = epoch})
"""

# Registers a pool, or re-registers it: a new epoch, and every block free again.
REGISTER = LIB + r"""
-- KEYS[1..13]: pool keys; KEYS[14]: request key.
-- ARGV[1]: JSON {pool, rid, digest, req_ttl_ms, num_blocks, block_size, num_layers,
--   num_kv_heads, head_dim, dtype, worker_address}
-- Returns JSON {pool, epoch, registered_ms}.
local p = cjson.decode(ARGV[1])
local prev = replay(p)
if prev then return prev end
local now = now_ms()
local epoch = redis.call('HINCRBY', K_META, 'epoch', 1)
for i = 2, 13 do redis.call('UNLINK', KEYS[i]) end
redis.call('HSET', K_META, 'pool_id', p.pool, 'num_blocks', p.num_blocks, 'block_size', p.block_size,
  'num_layers', p.num_layers, 'num_kv_heads', p.num_kv_heads, 'head_dim', p.head_dim,
  'dtype', p.dtype, 'worker_address', p.worker_address, 'registered_ms', now)
redis.call('HDEL', K_META, 'heartbeat_ms')
redis.call('HSET', K_STATE, 'fresh', 0, 'clock', 0)
return remember(p, cjson.encode({pool = p.pool, epoch = epoch, registered_ms = now}))
"""

# A worker's heartbeat: stamps the pool's meta with the Redis clock if the epoch matches.
HEARTBEAT = r"""
-- KEYS[1]: the pool's meta hash. ARGV[1]: pool id; ARGV[2]: the worker's epoch.
-- Returns JSON {epoch, heartbeat_ms}, or an error (NOT_FOUND, FAILED_PRECONDITION).
local pool, epoch = ARGV[1], tonumber(ARGV[2])
local current = tonumber(redis.call('HGET', KEYS[1], 'epoch'))
if not current or not redis.call('HGET', KEYS[1], 'num_blocks') then
  return cjson.encode({err = 'NOT_FOUND', msg = 'pool ' .. pool .. ' is not registered'})
end
if current ~= epoch then
  return cjson.encode({err = 'FAILED_PRECONDITION', epoch = current,
    msg = 'pool ' .. pool .. ' is at epoch ' .. current .. ', not ' .. ARGV[2] .. ' (re-registered since)'})
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'heartbeat_ms', now)
return cjson.encode({epoch = current, heartbeat_ms = now})
"""

# Read-only: how much of a prompt a pool has cached, and how many blocks it could give.
PROBE = LIB + r"""
-- KEYS[1..13]: pool keys.
-- ARGV[1]: JSON {pool, e = epoch, hs = [hash hex of the blocks a hit may cover]}
-- Returns JSON {epoch, hits, available}.
local p = cjson.decode(ARGV[1])
local ok, res = pcall(function()
  local epoch, num_blocks = pool_meta(p.pool)
  local hits = 0
  if epoch == p.e and #p.hs > 0 then
    local got = hmget_chunked(K_H2B, p.hs)
    for i = 1, #got do
      if not got[i] then break end
      hits = i
    end
  end
  return {epoch = epoch, hits = hits, available = available_now(num_blocks)}
end)
if not ok then
  if type(res) == 'table' then return fail_reply(res) end
  error(res)
end
return cjson.encode(res)
"""

# Pool side of a keep-alive: raises the lease's deadline where it is known.
LEASE_TOUCH = r"""
-- KEYS[1]: the pool's leases zset. ARGV[1]: lease id; ARGV[2]: new deadline (ms).
-- Returns 1 if the lease was known in the pool, else 0.
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], 'GT', ARGV[2], ARGV[1])
  return 1
end
return 0
"""

# Lease scripts share their checks.
LEASE_LIB = r"""
local K_LEASE, K_POOLS = KEYS[1], KEYS[2]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function live_lease(lease_id, now)
  local l = redis.call('HMGET', K_LEASE, 'tenant', 'ttl_ms', 'deadline', 'revoked')
  if not l[1] then
    return nil, cjson.encode({err = 'NOT_FOUND', msg = 'lease ' .. lease_id .. ' not found'})
  end
  if l[4] == '1' then
    return nil, cjson.encode({err = 'FAILED_PRECONDITION', msg = 'lease ' .. lease_id .. ' was revoked'})
  end
  if tonumber(l[3]) <= now then
    return nil, cjson.encode({err = 'FAILED_PRECONDITION', msg = 'lease ' .. lease_id .. ' has expired'})
  end
  return {tenant = l[1], ttl_ms = tonumber(l[2]), deadline = tonumber(l[3])}, nil
end
"""

LEASE_GRANT = LEASE_LIB + r"""
-- KEYS: lease hash, lease pools set. ARGV[1]: JSON {lease, tenant, ttl_ms, digest, rid, tombstone_ms}
-- Returns JSON {lease, tenant, ttl_ms, deadline}; a retried grant (same digest) returns
-- the lease as it is now, with replay = true.
local p = cjson.decode(ARGV[1])
local now = now_ms()
local have = redis.call('HMGET', K_LEASE, 'digest', 'tenant', 'ttl_ms', 'deadline')
if have[1] then
  if have[1] ~= p.digest then
    return cjson.encode({err = 'INVALID_ARGUMENT',
      msg = 'request_id ' .. p.rid .. ' was already used with different arguments'})
  end
  return cjson.encode({lease = p.lease, tenant = have[2], ttl_ms = tonumber(have[3]), deadline = tonumber(have[4]),
    replay = true})
end
local deadline = now + p.ttl_ms
redis.call('HSET', K_LEASE, 'tenant', p.tenant, 'ttl_ms', p.ttl_ms, 'deadline', deadline,
  'revoked', 0, 'digest', p.digest)
redis.call('PEXPIRE', K_LEASE, p.ttl_ms + p.tombstone_ms)
return cjson.encode({lease = p.lease, tenant = p.tenant, ttl_ms = p.ttl_ms, deadline = deadline})
"""

LEASE_KEEPALIVE = LEASE_LIB + r"""
-- KEYS: lease hash, lease pools set. ARGV[1]: JSON {lease, tombstone_ms}
-- Returns JSON {lease, tenant, ttl_ms, deadline, pools}.
local p = cjson.decode(ARGV[1])
local now = now_ms()
local l, e = live_lease(p.lease, now)
if not l then return e end
local deadline = now + l.ttl_ms
redis.call('HSET', K_LEASE, 'deadline', deadline)
redis.call('PEXPIRE', K_LEASE, l.ttl_ms + p.tombstone_ms)
redis.call('PEXPIRE', K_POOLS, l.ttl_ms + p.tombstone_ms)
return cjson.encode({lease = p.lease, tenant = l.tenant, ttl_ms = l.ttl_ms, deadline = deadline,
  pools = redis.call('SMEMBERS', K_POOLS)})
"""

LEASE_ATTACH = LEASE_LIB + r"""
-- KEYS: lease hash, lease pools set. ARGV[1]: JSON {lease, pools = [pool ids], tombstone_ms}
-- Checks that the lease is live and records the pools where it will hold sequences.
-- Returns JSON {tenant, deadline}.
local p = cjson.decode(ARGV[1])
local l, e = live_lease(p.lease, now_ms())
if not l then return e end
if #p.pools > 0 then
  redis.call('SADD', K_POOLS, unpack(p.pools))
  redis.call('PEXPIRE', K_POOLS, (l.deadline - now_ms()) + p.tombstone_ms)
end
return cjson.encode({tenant = l.tenant, deadline = l.deadline})
"""

LEASE_REVOKE = LEASE_LIB + r"""
-- KEYS: lease hash, lease pools set. ARGV[1]: JSON {lease}
-- Marks the lease revoked (idempotent). Returns JSON {pools}: the pools to reap.
local p = cjson.decode(ARGV[1])
if redis.call('EXISTS', K_LEASE) == 0 then
  return cjson.encode({err = 'NOT_FOUND', msg = 'lease ' .. p.lease .. ' not found'})
end
redis.call('HSET', K_LEASE, 'revoked', 1, 'deadline', 0)
return cjson.encode({pools = redis.call('SMEMBERS', K_POOLS)})
"""


# Metrics: the exporter lease (see kvservice.common.metrics). Not allocator state.
EXPORTER_CLAIM = r"""
-- KEYS[1]: the exporter key. ARGV[1]: this replica's id; ARGV[2]: TTL in ms.
-- Takes the lease if nobody holds it, renews it if this replica does.
-- Returns 1 if this replica holds the lease now, else 0.
local key, me, ttl = KEYS[1], ARGV[1], ARGV[2]
local holder = redis.call('GET', key)
if holder and holder ~= me then
  return 0
end
redis.call('SET', key, me, 'PX', ttl)
return 1
"""

EXPORTER_RELEASE = r"""
-- KEYS[1]: the exporter key. ARGV[1]: this replica's id.
-- Drops the lease if this replica holds it. Returns 1 if it did, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
