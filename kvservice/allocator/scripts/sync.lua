--- sync: a lease's Sync in one pool: applies its journal of local changes in order,
--- then refills (or takes back) its reserve and grants it sequence numbers. The lease
--- joins the pool's leases (with its deadline), so that everything it holds is reclaimed
--- when it expires.
---
--- Journal entries are numbered from 1 per (lease, pool epoch); the pool keeps the last
--- applied number (K_JOURNAL). A batch that starts after a gap is not applied (the reply's
--- applied says where to resume); entries applied before are skipped (a resend is a
--- no-op); the rest are applied all-or-nothing, each as its kind says:
---   grow   {sequence, num_tokens, blocks, commits?}: blocks (from the lease's reserve)
---          appended to the table, which then covers num_tokens; then the commits, if any
---          (as a commit entry's);
---   copy   {sequence, num_tokens, blocks = [dst]}: copy-on-write: dst (from the reserve)
---          replaces the shared partial last block (which loses a reference);
---   commit {sequence, num_tokens, num_committed_blocks (the first index), parent_hash,
---          commits = [hash hex of each block]}: full blocks join the prefix cache;
---   fork   {sequence, num_tokens, child}: a child (a sequence number granted to the
---          lease) shares every block of the sequence;
---   free   {sequence, num_tokens}: references dropped, last block first; a partial block
---          that reaches 0 goes back to the lease's reserve (the client keeps it), a full
---          one to the evictable set (hashed) or the free list.
--- Every entry first sets the sequence's length to num_tokens (never below the recorded
--- one, never beyond its table; not into a shared partial block: copy first).
---
--- KEYS[1..15]: the pool's keys (kvservice/allocator/keys.py); KEYS[16]: the request key.
--- ARGV[1]: msgpack map {pool, epoch, request_id ('': none), fingerprint, request_ttl_ms,
---   lease_id, lease_deadline_ms (0: attached to the pool already), first_entry (the
---   number of entries[1]), entries, want (the reserve size asked for), cap (the most a
---   lease may hold), pressure_blocks (below this many free + evictable blocks the cap
---   drops to pressure_cap), pressure_cap, returned = [blocks given back],
---   want_sequence_numbers, need (blocks wanted in reserve at once, even beyond the cap)}
--- Returns msgpack {epoch, applied (the last entry applied), granted = [blocks added to
---   the reserve], num_reserved (the lease's reserve after the call), cap (the cap now:
---   the lease returns any surplus), first_sequence_number, num_sequence_numbers};
---   or an error (lib/codec): NOT_FOUND, INVALID_ARGUMENT (an entry or a returned block
---   that does not fit the state: nothing applied), FAILED_PRECONDITION (reasons
---   EPOCH_CHANGED, LEASE_EXPIRED), and the internal LEASE_UNKNOWN.
--- @include "lib/time"
--- @include "lib/request"
--- @include "lib/refs"
--- @include "lib/reserve"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
local prev = replay(K_REQUEST, p)
if prev then return prev end
local lease = p.lease_id

-- Checks the epoch and the lease; returns the pool's geometry and whether the lease must
-- be attached to the pool.
local function check_pool_and_lease()
  local epoch, num_blocks, bs = pool_meta(p.pool)
  if p.epoch ~= epoch then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' is at epoch ' .. epoch .. ', not ' ..
      string.format('%d', p.epoch) .. ' (re-registered since)', {reason = 'EPOCH_CHANGED', epoch = epoch})
  end
  local attach = lease_in_pool(p.pool, lease, p.lease_deadline_ms, now_ms(), true)
  return epoch, num_blocks, bs, attach
end

-- ------------------------------------------------------------------ journal

local recs, born, gone = {}, {}, {}   -- sequence field -> record; new and freed fields
local stored = {}                     -- sequence field -> its record as read up front
local known = {}                      -- hash -> block id or false, as read up front
local hashed_before = {}              -- block -> its hash or false, read up front
local mine = {}                       -- this lease's reserved blocks (true) as planned
local from_reserve, to_reserve = {}, {}
local pending, reg_hs, reg_bs, dups = {}, {}, {}, {}
local stats = {cow_copies = 0, sequences_created = 0, sequences_freed = 0}
local entry_no = 0

local function refuse(message)
  bad('INVALID_ARGUMENT', 'journal entry ' .. string.format('%d', entry_no) .. ': ' .. message)
end

local function field_of(n)
  return string.format('%d', n)
end

-- The record of sequence n as planned so far (loaded on first use; owned by the lease).
local function rec_of(n)
  local f = field_of(n)
  local rec = recs[f]
  if rec == false or gone[f] then refuse('sequence ' .. f .. ' not found') end
  if rec == nil then
    rec = stored[f]
    if not rec then recs[f] = false; refuse('sequence ' .. f .. ' not found') end
    if rec.l ~= lease then refuse('sequence ' .. f .. ' belongs to another lease') end
    recs[f] = rec
  end
  return rec, f
end

local function last_block(rec)
  return rec_block(rec, rec_len(rec))
end

-- Takes a block of the lease's reserve for a table.
local function take(b)
  if not mine[b] then refuse('block ' .. field_of(b) .. ' is not in the reserve of lease ' .. lease) end
  mine[b] = nil
  if init[b] == nil then init[b] = 'r'; orig[b] = 0 end
  refs[b] = 1
  from_reserve[b] = true
  to_reserve[b] = nil
end

-- Sets the sequence's length (every entry does first).
local function set_length(rec, t, bs)
  if t < rec.t then refuse('num_tokens ' .. t .. ' is below the recorded ' .. rec.t) end
  if t > rec_len(rec) * bs then
    refuse('num_tokens ' .. t .. ' exceeds the block table (' .. rec_len(rec) .. ' blocks of ' .. bs .. ')')
  end
  if t > rec.t and rec.t % bs ~= 0 then
    local last = last_block(rec)
    load_refs({last})
    if refs[last] > 1 then
      refuse('tokens were appended into the shared last block ' .. field_of(last) .. ' without a copy')
    end
  end
  rec.t = t
end

-- Registers the hashes of a commit (a COMMIT entry's, or a GROW entry's commits).
local function commit_blocks(rec, e, bs)
  local first, hs = e.num_committed_blocks, e.commits
  if first ~= rec.c then refuse('commit starts at block ' .. first .. ' but ' .. rec.c .. ' blocks are committed') end
  if e.parent_hash ~= rec.h then refuse('parent_hash does not match the last committed block') end
  if (first + #hs) * bs > rec.t then
    refuse('block ' .. (first + #hs - 1) .. ' is not full at num_tokens ' .. rec.t)
  end
  local blocks, fields, cur = {}, {}, {}
  for j = 1, #hs do
    local b = rec_block(rec, first + j)
    blocks[j] = b
    if hashed_before[b] ~= nil then cur[j] = hashed_before[b] else fields[#fields + 1] = D[b] or dec(b) end
  end
  if #fields > 0 then   -- (blocks that the batch moved since the records were read)
    local got, k = hmget_chunked(K_B2H, fields), 0
    for j = 1, #hs do
      if cur[j] == nil then k = k + 1; cur[j] = got[k] or false end
    end
  end
  for j, h in ipairs(hs) do
    local b = blocks[j]
    if not cur[j] and not pending[h] then
      if not known[h] then
        pending[h] = b
        reg_hs[#reg_hs + 1] = h; reg_bs[#reg_bs + 1] = b
      elseif not dups[h] then
        dups[h] = b
      end
    end
  end
  rec.c = first + #hs
  if #hs > 0 then rec.h = hs[#hs] end
end

local function apply_entry(e, bs)
  local rec, f = rec_of(e.sequence)
  local kind = e.kind
  if kind == 'grow' then
    local nb = rec_len(rec)
    if #e.blocks ~= math.ceil(e.num_tokens / bs) - nb then
      refuse('grow to ' .. e.num_tokens .. ' tokens needs ' .. (math.ceil(e.num_tokens / bs) - nb) ..
        ' blocks, got ' .. #e.blocks)
    end
    if rec.t % bs ~= 0 and nb > 0 and e.num_tokens > rec.t then
      local last = last_block(rec)
      load_refs({last})
      if refs[last] > 1 then refuse('the shared last block ' .. field_of(last) .. ' must be copied first') end
    end
    for _, b in ipairs(e.blocks) do
      take(b)
      rec.add[#rec.add + 1] = b
    end
    set_length(rec, e.num_tokens, bs)
    if #e.commits > 0 then commit_blocks(rec, e, bs) end
  elseif kind == 'copy' then
    local nb = rec_len(rec)
    if #e.blocks ~= 1 or nb == 0 or rec.t % bs == 0 then refuse('copy needs one block and a partial last block') end
    local src = last_block(rec)
    load_refs({src})
    if refs[src] < 2 then refuse('block ' .. field_of(src) .. ' is not shared: nothing to copy') end
    local dst = e.blocks[1]
    take(dst)
    refs[src] = refs[src] - 1
    if nb > rec.nb then rec.add[nb - rec.nb] = dst else rec.cowlast = dst end
    stats.cow_copies = stats.cow_copies + 1
    set_length(rec, e.num_tokens, bs)
  elseif kind == 'commit' then
    set_length(rec, e.num_tokens, bs)
    commit_blocks(rec, e, bs)
  elseif kind == 'fork' then
    set_length(rec, e.num_tokens, bs)
    local cf = field_of(e.child)
    if recs[cf] or redis.call('HEXISTS', K_SEQS, cf) == 1 then refuse('sequence ' .. cf .. ' exists already') end
    if e.child < 1 or e.child > (tonumber(redis.call('HGET', K_META, 'next_seq')) or 0) then
      refuse('sequence number ' .. cf .. ' was never granted')
    end
    local blocks = rec_blocks(rec)
    load_refs(blocks)
    for _, b in ipairs(blocks) do refs[b] = refs[b] + 1 end
    recs[cf] = {l = lease, t = rec.t, c = rec.c, h = rec.h, k = rec.k, tab = rec_tab(rec, {}), nb = rec_len(rec),
                add = {}, lastb = false}
    born[cf] = true
    stats.sequences_created = stats.sequences_created + 1
  elseif kind == 'free' then
    set_length(rec, e.num_tokens, bs)
    local n = rec_len(rec)
    local blocks = rec_blocks(rec)
    load_refs(blocks)
    for i = n, 1, -1 do
      local b = blocks[i]
      decref(b)
      if refs[b] == 0 and i * bs > rec.t then to_reserve[b] = true; mine[b] = true end
    end
    gone[f] = true
    stats.sequences_freed = stats.sequences_freed + 1
  else
    refuse('unknown kind ' .. tostring(kind))
  end
end

-- Writes the planned journal: hashes, reference counts, where blocks that reached 0 go,
-- the records.
local function write_journal()
  local h2b, b2h = {}, {}
  for k = 1, #reg_hs do
    local s = D[reg_bs[k]] or dec(reg_bs[k])
    h2b[#h2b + 1] = reg_hs[k]; h2b[#h2b + 1] = s
    b2h[#b2h + 1] = s; b2h[#b2h + 1] = reg_hs[k]
  end
  local hashed = zero_hashed(nil)
  if #h2b > 0 then
    call_chunked('HSET', K_H2B, h2b, 2)
    call_chunked('HSET', K_B2H, b2h, 2)
    for _, b in ipairs(reg_bs) do hashed[b] = true end
  end
  local set_ref, del_ref, unreserve, reserve_add, to_free, to_evict = {}, {}, {}, {}, {}, {}
  local clock = nil
  for b, r in pairs(refs) do
    local s = D[b] or dec(b)
    if r > 0 then
      if r ~= orig[b] then set_ref[#set_ref + 1] = s; set_ref[#set_ref + 1] = D[r] or dec(r) end
      if init[b] == 'r' then unreserve[#unreserve + 1] = reserve_member(lease, b) end
    elseif init[b] == 'u' or init[b] == 'r' then
      if init[b] == 'u' then del_ref[#del_ref + 1] = s end
      if to_reserve[b] then
        if init[b] == 'u' then reserve_add[#reserve_add + 1] = 0; reserve_add[#reserve_add + 1] = reserve_member(lease, b) end
      else
        if init[b] == 'r' then unreserve[#unreserve + 1] = reserve_member(lease, b) end
        if hashed[b] then
          if clock == nil then clock = tonumber(redis.call('HGET', K_STATE, 'clock')) or 0 end
          clock = clock + 1
          to_evict[#to_evict + 1] = clock; to_evict[#to_evict + 1] = s
        else
          to_free[#to_free + 1] = s
        end
      end
    end
  end
  if clock ~= nil then redis.call('HSET', K_STATE, 'clock', clock) end
  if #set_ref > 0 then call_chunked('HSET', K_REF, set_ref, 2) end
  if #del_ref > 0 then call_chunked('HDEL', K_REF, del_ref) end
  if #unreserve > 0 then call_chunked('ZREM', K_RESERVE, unreserve) end
  if #reserve_add > 0 then call_chunked('ZADD', K_RESERVE, reserve_add, 2) end
  if #to_evict > 0 then call_chunked('ZADD', K_EVICT, to_evict, 2) end
  if #to_free > 0 then call_chunked('RPUSH', K_FREE, to_free) end
  local put_meta, put_tab, lseq_add, del, lseq_del = {}, {}, {}, {}, {}
  for f, rec in pairs(recs) do
    if rec then
      if gone[f] then
        if not born[f] then
          del[#del + 1] = f
          lseq_del[#lseq_del + 1] = lease .. ':' .. f
        end
      else
        put_meta[#put_meta + 1] = f; put_meta[#put_meta + 1] = meta_string(rec)
        put_tab[#put_tab + 1] = f; put_tab[#put_tab + 1] = rec_tab(rec, {})
        if born[f] then lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. f end
      end
    end
  end
  write_records(put_meta, put_tab, del, lseq_add, lseq_del)
end

-- ------------------------------------------------------------------ plan, then write

local ok, plan = guarded(function()
  local epoch, num_blocks, bs, attach = check_pool_and_lease()
  local held = reserved_blocks(lease)
  for _, b in ipairs(held) do mine[b] = true end
  local applied = tonumber(redis.call('HGET', K_JOURNAL, lease)) or 0
  local first = p.first_entry
  local entries = p.entries
  local done = 0
  if #entries > 0 then
    stats.journal_batches = 1
    if first > applied + 1 then
      stats.journal_gaps = 1
    else
      stats.journal_resent_entries = math.min(#entries, applied + 1 - first)
    end
  end
  if #entries > 0 and first <= applied + 1 then
    -- Read up front, in two calls each: the records of every sequence the new entries
    -- name, and which of their commits' hashes are cached already.
    local fields, seen, hashes = {}, {}, {}
    for i = applied + 2 - first, #entries do
      local e = entries[i]
      local f = field_of(e.sequence)
      if not seen[f] then seen[f] = true; fields[#fields + 1] = f end
      for _, h in ipairs(e.commits) do hashes[#hashes + 1] = h end
    end
    if #fields > 0 then
      local metas, tabs = hmget_chunked(K_SEQS, fields), hmget_chunked(K_TABS, fields)
      local lasts = {}
      for i, f in ipairs(fields) do
        if metas[i] then
          local rec = load_rec(metas[i], tabs[i])
          stored[f] = rec
          if rec.nb > 0 and rec.l == lease then lasts[#lasts + 1] = rec_block(rec, rec.nb) end
        end
      end
      load_refs(lasts)   -- the last blocks: whether a write must copy them first
    end
    if #hashes > 0 then
      local got = hmget_chunked(K_H2B, hashes)
      for i, h in ipairs(hashes) do known[h] = got[i] or false end
      -- the blocks the commits name, where the records say they are
      local blocks, bfields = {}, {}
      for i = applied + 2 - first, #entries do
        local e = entries[i]
        local rec = stored[field_of(e.sequence)]
        if rec and #e.commits > 0 then
          for j = 1, #e.commits do
            local idx = e.num_committed_blocks + j
            if idx <= rec.nb then
              local b = rec_block(rec, idx)
              if not blocks[b] then blocks[b] = true; bfields[#bfields + 1] = D[b] or dec(b) end
            end
          end
        end
      end
      if #bfields > 0 then
        local cur = hmget_chunked(K_B2H, bfields)
        for i, s in ipairs(bfields) do hashed_before[tonumber(s)] = cur[i] or false end
      end
    end
    for i = applied + 2 - first, #entries do
      entry_no = first + i - 1
      apply_entry(entries[i], bs)
      done = done + 1
    end
  end
  for _, b in ipairs(p.returned) do
    if not mine[b] then
      bad('INVALID_ARGUMENT', 'block ' .. field_of(b) .. ' is not in the reserve of lease ' .. lease ..
        ' in pool ' .. p.pool)
    end
    mine[b] = nil
  end
  local kept = 0
  for _ in pairs(mine) do kept = kept + 1 end
  local available = available_now(num_blocks)
  local cap = p.cap
  if available < p.pressure_blocks then cap = math.min(cap, p.pressure_cap) end
  local need = math.max(0, math.max(math.min(p.want, cap), p.need) - kept)
  return {epoch = epoch, num_blocks = num_blocks, attach = attach, kept = kept, cap = cap,
          need = math.min(need, available), applied = applied + done, done = done}
end)
if not ok then return plan end

if plan.done > 0 then
  write_journal()
  redis.call('HSET', K_JOURNAL, lease, plan.applied)
  stats.journal_entries = plan.done
end
if #p.returned > 0 then
  local members, fields = {}, {}
  for i, b in ipairs(p.returned) do members[i] = reserve_member(lease, b); fields[i] = D[b] or dec(b) end
  call_chunked('ZREM', K_RESERVE, members)
  call_chunked('RPUSH', K_FREE, fields)
end
local granted = {}
if plan.need > 0 then
  local moved = {}
  granted = take_blocks(plan.need, plan.num_blocks, dups, moved, stats)
  for _, m in ipairs(moved) do
    local s = D[m[2]] or dec(m[2])
    redis.call('HSET', K_H2B, m[1], s)
    redis.call('HSET', K_B2H, s, m[1])
  end
  local add = {}
  for _, b in ipairs(granted) do add[#add + 1] = 0; add[#add + 1] = reserve_member(lease, b) end
  call_chunked('ZADD', K_RESERVE, add, 2)
  stats.blocks_allocated = #granted
end
local first_seq, num_seqs = 0, 0
if p.want_sequence_numbers > 0 then
  num_seqs = p.want_sequence_numbers
  first_seq = redis.call('HINCRBY', K_META, 'next_seq', num_seqs) - num_seqs + 1
end
if plan.attach then redis.call('ZADD', K_LEASES, 'GT', p.lease_deadline_ms, lease) end
incr_stats(stats)
return remember(K_REQUEST, p, reply({epoch = plan.epoch, applied = plan.applied, granted = granted,
                                    num_reserved = plan.kept + #granted, cap = plan.cap,
                                    first_sequence_number = first_seq, num_sequence_numbers = num_seqs}))
