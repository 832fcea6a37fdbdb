--- Sequence records as stored: ``seqs`` holds "<lease> <num_tokens> <committed blocks>
--- <cached tokens> <last hash hex> <num blocks>[ <state>]", ``tabs`` the block table in
--- pages of PAGE blocks, W hex digits per block id: page 0 under the sequence's field
--- "<n>", page k under "<n>:<k>" (see kvservice/allocator/keys.py). So a step reads and
--- rewrites one page (the last) however long the sequence is.
---
--- The state is absent for a live sequence; "s" (staged) for a record that a run is
--- building (a create, a fork or a resync claim larger than one call: scripts/stage.lua),
--- "f" for one being freed in parts. Neither is a sequence to its caller: every lookup by
--- number answers NOT_FOUND; they hold their blocks (counted as references) until the run
--- ends, and the reaper frees them with their lease.
---
--- A loaded record is read lazily: rec.nb blocks as stored (pages loaded on first use),
--- rec.cowlast replacing its last block, rec.add appended (placeholders < 0 until the write
--- phase maps them to blocks).
local W = 6        -- hex digits per block id (ids < 2^24, the largest pool)
local PAGE = 128   -- blocks per stored page

local function page_field(f, k)
  if k == 0 then return f end
  return f .. ':' .. k
end

-- The page (0-based) that holds block i (1-based).
local function page_of(i)
  return math.floor((i - 1) / PAGE)
end

-- The page fields of a table of nb blocks.
local function page_fields(f, nb)
  local out = {}
  if nb > 0 then
    for k = 0, page_of(nb) do out[#out + 1] = page_field(f, k) end
  end
  return out
end

-- A record from its meta string (nil when malformed); f: its field (the sequence number).
local function load_rec(f, meta)
  local l, t, c, k, h, nb, st = string.match(meta, '^(%S+) (%d+) (%d+) (%d+) (%x+) (%d+) ?(%a?)$')
  if not l then return nil end
  -- lastb: the stored last block once read (a slot made here costs less than a rehash later)
  return {f = f, l = l, t = tonumber(t), c = tonumber(c), k = tonumber(k), h = h, nb = tonumber(nb), st = st,
          pages = {}, add = {}, lastb = false}
end

local function load_page(rec, k)
  local s = redis.call('HGET', K_TABS, page_field(rec.f, k)) or ''
  rec.pages[k] = s
  return s
end

-- Loads the last stored page of each record in one call (the page a step reads and
-- rewrites: its last block, its growth).
local function load_last_pages(recs)
  local fields, which = {}, {}
  for _, rec in pairs(recs) do
    if rec and rec.nb > 0 then
      local k = page_of(rec.nb)
      if rec.pages[k] == nil then
        fields[#fields + 1] = page_field(rec.f, k)
        which[#which + 1] = {rec, k}
      end
    end
  end
  if #fields == 0 then return end
  local got = hmget_chunked(K_TABS, fields)
  for i, x in ipairs(which) do x[1].pages[x[2]] = got[i] or '' end
end

-- Loads every stored page of a record not loaded yet (one call).
local function load_all_pages(rec)
  local fields, which = {}, {}
  for k, f in ipairs(page_fields(rec.f, rec.nb)) do
    if rec.pages[k - 1] == nil then fields[#fields + 1] = f; which[#which + 1] = k - 1 end
  end
  if #fields == 0 then return end
  local got = hmget_chunked(K_TABS, fields)
  for i, k in ipairs(which) do rec.pages[k] = got[i] or '' end
end

local function meta_string(rec)
  local s = rec.l .. ' ' .. rec.t .. ' ' .. rec.c .. ' ' .. rec.k .. ' ' .. rec.h .. ' ' ..
    (rec.nb + #rec.add + (rec.graft_n or 0))
  if rec.st and rec.st ~= '' then s = s .. ' ' .. rec.st end
  return s
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
  local k = page_of(i)
  local s = rec.pages[k] or load_page(rec, k)
  local o = (i - 1 - k * PAGE) * W
  return tonumber(string.sub(s, o + 1, o + W), 16)
end

-- Blocks a .. b of the record (all of them by default), as a list.
local function rec_blocks(rec, a, b)
  local out = {}
  a, b = a or 1, b or rec_len(rec)
  for i = a, b do out[#out + 1] = rec_block(rec, i) end
  return out
end

-- The whole block table as a list of ids, placeholders resolved through map (for replies).
local function rec_table(rec, map)
  local out = rec_blocks(rec)
  for i, b in ipairs(out) do
    if b < 0 then out[i] = map[b] end
  end
  return out
end

-- Appends to ``out`` the (field, page) pairs to store for the record: the pages its
-- copy-on-write or growth changed, or every page of a record not stored yet (rec.new).
-- Placeholders are resolved through map.
local function rec_page_writes(rec, map, out)
  local nb, add = rec.nb, rec.add
  if not rec.new and not rec.cowlast and #add == 0 and not rec.graft_hex then return end
  local k = nb > 0 and page_of(nb) or 0
  if rec.new then
    for j = 0, k - 1 do out[#out + 1] = page_field(rec.f, j); out[#out + 1] = rec.pages[j] or load_page(rec, j) end
  end
  local s = ''
  if nb > 0 then s = rec.pages[k] or load_page(rec, k) end
  if rec.cowlast then s = string.sub(s, 1, #s - W) .. hexid(map[rec.cowlast] or rec.cowlast) end
  local hex = hexids(add, map)
  if rec.graft_hex then hex = hex .. rec.graft_hex end     -- (blocks staged by a grow run: scripts/step.lua)
  if nb == 0 and #hex == 0 then return end
  local room = PAGE * W - #s
  out[#out + 1] = page_field(rec.f, k); out[#out + 1] = s .. string.sub(hex, 1, room)
  local pos = room + 1
  while pos <= #hex do
    k = k + 1
    out[#out + 1] = page_field(rec.f, k); out[#out + 1] = string.sub(hex, pos, pos + PAGE * W - 1)
    pos = pos + PAGE * W
  end
end

-- Cuts a stored record's table to its first nb blocks: appends to ``writes`` the new last
-- page and to ``dels`` the pages past it. (No pending changes: rec.add is empty.)
local function rec_truncate(rec, nb, writes, dels)
  local old = rec.nb
  local last = nb > 0 and page_of(nb) or -1
  for k = last + 1, (old > 0 and page_of(old) or -1) do dels[#dels + 1] = page_field(rec.f, k) end
  if nb > 0 and nb < old then
    local s = rec.pages[last] or load_page(rec, last)
    local keep = (nb - last * PAGE) * W
    if keep < #s then
      s = string.sub(s, 1, keep)
      rec.pages[last] = s
      writes[#writes + 1] = page_field(rec.f, last); writes[#writes + 1] = s
    end
  end
  rec.nb = nb
end

-- The blocks a step appended to the record, resolved through map (for replies).
local function rec_added(rec, map)
  local out = {}
  for i, b in ipairs(rec.add) do out[i] = map[b] or b end
  return out
end
