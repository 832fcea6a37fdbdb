--- Sequence records as stored: ``seqs`` holds "<lease> <num_tokens> <committed blocks>
--- <cached tokens> <last hash hex>", ``tabs`` the block table as W hex digits per block id
--- (see kvservice/allocator/keys.py). A loaded record is read lazily: rec.tab / rec.nb as
--- stored, rec.cowlast replacing its last block, rec.add appended (placeholders < 0 until
--- the write phase maps them to blocks).
local W = 6   -- hex digits per block id (ids < 2^24, the largest pool)

local function load_rec(meta, tab)
  local l, t, c, k, h = string.match(meta, '^(%S+) (%d+) (%d+) (%d+) (%x+)$')
  tab = tab or ''
  -- lastb: the stored last block once read (a slot made here costs less than a rehash later)
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

-- The whole block table as a list of ids, placeholders resolved through map (for replies).
local function rec_table(rec, map)
  local out = rec_blocks(rec)
  for i, b in ipairs(out) do
    if b < 0 then out[i] = map[b] end
  end
  return out
end

-- The table to store, placeholders resolved through map.
local function rec_tab(rec, map)
  local tab = rec.tab
  if rec.cowlast then
    tab = string.sub(tab, 1, (rec.nb - 1) * W) .. hexid(map[rec.cowlast] or rec.cowlast)
  end
  if #rec.add == 0 then return tab end
  return tab .. hexids(rec.add, map)
end

-- The blocks a step appended to the record, resolved through map (for replies).
local function rec_added(rec, map)
  local out = {}
  for i, b in ipairs(rec.add) do out[i] = map[b] or b end
  return out
end
