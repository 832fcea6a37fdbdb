--- sync: a lease's Sync in one pool: applies its journal of local changes in order,
--- then refills (or takes back) its reserve and grants it sequence numbers. The lease
--- joins the pool's leases (with its deadline), so that everything it holds is reclaimed
--- when it expires.
---
--- Journal entries are numbered from 1 per (lease, pool epoch); the pool keeps the last
--- applied number (K_JOURNAL, lib/reserve). A batch that starts after a gap is not applied (the reply's
--- applied says where to resume); entries applied before are skipped (a resend is a
--- no-op); the rest are applied all-or-nothing, each as its kind says (kinds 1..5, the
--- proto's JournalKind):
---   1 grow   blocks (from the lease's reserve) appended to the table, which then covers
---            num_tokens; then the commits, if any (as a commit entry's);
---   2 copy   copy-on-write: the entry's block (from the reserve) replaces the shared
---            partial last block (which loses a reference);
---   3 commit the next full blocks after the committed ones join the prefix cache (parent:
---            the sequence's last hash; commits: the hash hex of each block);
---   4 fork   a child (a sequence number granted to the lease) shares every block;
---   5 free   references dropped, last block first; a partial block that reaches 0 goes
---            back to the lease's reserve (the client keeps it), a full one to the
---            evictable set (hashed) or the free list.
--- Every entry first sets the sequence's length to num_tokens (never below the recorded
--- one, never beyond its table; not into a shared partial block: copy first).
--- A FORK or FREE of a sequence longer than one call takes is sent alone with ``part``
--- and applied in parts of ``budget`` blocks (lib/runs: the child is staged meanwhile,
--- the freed sequence in state "f"); it counts as applied with its last part, and the
--- reply's ``applied`` says when (a resend continues where the parts stopped).
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31]: the request key.
--- ARGV[1]: msgpack map {pool, epoch, generation (the pool's as the client heard it,
---   lib/generation; 0: none), request_id ('': none), fingerprint, request_ttl_ms,
---   lease_id, tenant (the lease's), quota = {blocks, sequences} (the tenant's quotas in the
---   pool, lib/held; 0: none), lease_left_ms (the lease's time left, ms; 0: attached to the pool already),
---   touch_left_ms (the lease's time left after the Sync's keep-alive, raised here as lease_touch
---   does; 0: none), first_entry (the
---   number of the journal's first entry), journal = {n, and columns of n: kinds,
---   sequences, num_tokens, children, num_blocks, num_commits; blocks (num_blocks[i] per
---   entry, in order), commits (num_commits[i] hash hex per entry), parents (the parent
---   hash hex of each entry with commits)}, want (the reserve size asked for), cap (the most a
---   lease may hold), pressure_blocks (below this many free + evictable blocks the cap
---   drops to pressure_cap), pressure_cap, returned = [blocks given back],
---   want_sequence_numbers, need (blocks wanted in reserve at once, even beyond the cap;
---   max_need of them per call at most),
---   max_fork_refs (the block references the batch's forks may add at most), max_refill
---   (the most blocks a refill towards the reserve's size grants in one call), part (the
---   journal is one long FORK or FREE, applied in part: nothing else is done), budget
---   (the blocks of such a part)}
--- Returns msgpack {epoch, generation, applied (the last entry applied; a part: stuck, when a gap keeps it
---   from applying its entry), granted = [blocks added to
---   the reserve], num_reserved (the lease's reserve after the call), cap (the cap now:
---   the lease returns any surplus), first_sequence_number, num_sequence_numbers, quota (''
---   or the quota, 'blocks' or 'sequences', that kept the grant below what the step needs
---   now), quota_limit, tier_orders (lib/tiers: the copies down a tier of the blocks the
---   refill evicted, to run before those blocks are written), serial (the pool's change
---   counter: the serial of the grant of the blocks granted)};
---   or an error (lib/codec): NOT_FOUND, INVALID_ARGUMENT (an entry or a returned block
---   that does not fit the state: nothing applied), FAILED_PRECONDITION (reasons
---   EPOCH_CHANGED, LEASE_EXPIRED, RESYNC_IN_PROGRESS, ROLLED_BACK {generation}: nothing
---   applied, the keep-alive aside), and the internal LEASE_UNKNOWN.
--- @include "lib/request"
--- @include "lib/runs"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
TIER.orders = {}
touch_lease(p)
local ok0, gen = guarded(function() return checked_generation(p) end)
if not ok0 then return gen end
local prev = replay(K_REQUEST, p)
if prev then return prev end
local lease = p.lease_id

-- ------------------------------------------------------------------ journal

local recs, born, gone = {}, {}, {}   -- sequence field -> record; new and freed fields
local stored = {}                     -- sequence field -> its record as read up front
local known = {}                      -- hash -> block id or false, as read up front
local hashed_before = {}              -- block -> its hash or false, read up front
local mine = {}                       -- blocks in this lease's reserve (true), as planned
local reserve_delta = 0               -- the reserve's size change, as planned
local from_reserve, to_reserve = {}, {}
local pending, reg_hs, reg_bs, dups = {}, {}, {}, {}
local stats = {cow_copies = 0, sequences_created = 0, sequences_freed = 0}
local entry_no = 0
local fork_refs = 0                   -- block references the batch's forks added

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
    if not rec or rec.st ~= '' then recs[f] = false; refuse('sequence ' .. f .. ' not found') end
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
  reserve_delta = reserve_delta - 1
  if init[b] == nil then init[b] = 'r'; orig[b] = 0 end
  refs[b] = 1
  hashed_before[b] = false   -- (a reserved block never has a hash)
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
  local first, hs = rec.c, e.commits
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

local GROW, COPY, COMMIT, FORK, FREE = 1, 2, 3, 4, 5

-- Entries first .. J.n of the journal's columns as tables {kind, sequence, num_tokens,
-- child, blocks, commits, parent_hash}.
local function entry_views(J, first)
  local out = {}
  local bo, co, po = 0, 0, 0
  local kinds, nb, nc, blocks, commits = J.kinds, J.num_blocks, J.num_commits, J.blocks, J.commits
  for i = 1, J.n do
    local k, c = nb[i], nc[i]
    if i >= first then
      local e = {kind = kinds[i], sequence = J.sequences[i], num_tokens = J.num_tokens[i], child = J.children[i],
                 blocks = {}, commits = {}, parent_hash = ''}
      for j = 1, k do e.blocks[j] = blocks[bo + j] end
      if c > 0 then
        for j = 1, c do e.commits[j] = commits[co + j] end
        e.parent_hash = J.parents[po + 1]
      end
      out[#out + 1] = e
    end
    bo, co = bo + k, co + c
    if c > 0 then po = po + 1 end
  end
  return out
end

local function apply_entry(e, bs)
  local rec, f = rec_of(e.sequence)
  local kind = e.kind
  if kind == GROW then
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
  elseif kind == COPY then
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
  elseif kind == COMMIT then
    set_length(rec, e.num_tokens, bs)
    commit_blocks(rec, e, bs)
  elseif kind == FORK then
    set_length(rec, e.num_tokens, bs)
    local cf = field_of(e.child)
    if recs[cf] or redis.call('HEXISTS', K_SEQS, cf) == 1 then refuse('sequence ' .. cf .. ' exists already') end
    if e.child < 1 or e.child > (tonumber(redis.call('HGET', K_META, 'next_seq')) or 0) then
      refuse('sequence number ' .. cf .. ' was never granted')
    end
    fork_refs = fork_refs + math.ceil(e.num_tokens / bs)   -- (the SDK counts the same when it batches)
    if fork_refs > p.max_fork_refs then
      refuse('the batch\'s forks would add more than ' .. p.max_fork_refs .. ' block references')
    end
    local blocks = rec_blocks(rec)
    load_refs(blocks)
    for _, b in ipairs(blocks) do refs[b] = refs[b] + 1 end
    recs[cf] = {f = cf, l = lease, t = rec.t, c = rec.c, h = rec.h, k = rec.k, st = '', pages = {}, nb = 0,
                add = blocks, lastb = false, new = true}
    born[cf] = true
    stats.sequences_created = stats.sequences_created + 1
  elseif kind == FREE then
    set_length(rec, e.num_tokens, bs)
    local n = rec_len(rec)
    local blocks = rec_blocks(rec)
    load_refs(blocks)
    for i = n, 1, -1 do
      local b = blocks[i]
      decref(b)
      if refs[b] == 0 and i * bs > rec.t then to_reserve[b] = true; mine[b] = true; reserve_delta = reserve_delta + 1 end
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
  write_hashes(h2b, b2h)
  for _, b in ipairs(reg_bs) do hashed[b] = true end
  local w = changes()
  for b, r in pairs(refs) do
    local s = D[b] or dec(b)
    if r > 0 then
      if r ~= orig[b] then w.set_ref[#w.set_ref + 1] = s; w.set_ref[#w.set_ref + 1] = D[r] or dec(r) end
      if init[b] == 'r' then w.unreserve[#w.unreserve + 1] = s end
    elseif init[b] == 'u' or init[b] == 'r' then
      if init[b] == 'u' then w.del_ref[#w.del_ref + 1] = s end
      if to_reserve[b] then
        if init[b] == 'u' then w.reserve_add[#w.reserve_add + 1] = s; w.reserve_add[#w.reserve_add + 1] = lease end
      else
        if init[b] == 'r' then w.unreserve[#w.unreserve + 1] = s end
        park(w, s, hashed[b])
      end
    end
  end
  write_changes(w)
  local put_meta, put_tab, lseq_add, del, del_tab, lseq_del = {}, {}, {}, {}, {}, {}
  for f, rec in pairs(recs) do
    if rec then
      if gone[f] then
        if not born[f] then
          drop_record(rec, del, del_tab)
          lseq_del[#lseq_del + 1] = lease .. ':' .. f
        end
      else
        put_meta[#put_meta + 1] = f; put_meta[#put_meta + 1] = meta_string(rec)
        rec_page_writes(rec, {}, put_tab)
        if born[f] then lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. f end
      end
    end
  end
  write_records(put_meta, put_tab, del, del_tab, lseq_add, lseq_del)
end

-- ------------------------------------------------------------------ a long entry, in parts

-- One part of a FORK or FREE entry too long for one call (p.part: the journal holds that
-- entry alone; lib/runs): a fork's child is staged and gets the next blocks of its
-- parent's table, a free releases the sequence's last blocks; the entry counts as applied
-- with its last part. A resend continues where the parts stopped.
local function entry_part()
  local ok2, got = guarded(function()
    local epoch, num_blocks, bs, attach = check_sync_target(p)
    local applied = lease_progress(lease)
    local J = p.journal
    local out = {epoch = epoch, generation = gen, applied = applied, granted = {}, cap = p.cap,
                 first_sequence_number = 0, num_sequence_numbers = 0, quota = '', quota_limit = 0}
    if J.n ~= 1 or p.first_entry ~= applied + 1 then     -- (applied already, or a gap)
      out.stuck = p.first_entry > applied + 1
      return out
    end
    entry_no = applied + 1
    local e = entry_views(J, 1)[1]
    local f = field_of(e.sequence)
    local meta = redis.call('HGET', K_SEQS, f)
    local rec = meta and load_rec(f, meta)
    if not rec then refuse('sequence ' .. f .. ' not found') end
    if rec.l ~= lease then refuse('sequence ' .. f .. ' belongs to another lease') end
    return {out = out, e = e, rec = rec, num_blocks = num_blocks, bs = bs, attach = attach}
  end)
  if not ok2 then return got end
  if got.e == nil then
    local _, reserved = lease_progress(lease)
    got.num_reserved = reserved
    return reply(got)
  end
  local e, rec, out, bs = got.e, got.rec, got.out, got.bs
  if got.attach then extend_lease(lease, p.lease_left_ms, now_ms()) end
  local complete = false
  if e.kind == FREE then
    local ok3, err = guarded(function()
      if rec.st == '' then set_length(rec, e.num_tokens, bs)
      elseif rec.st ~= 'f' then refuse('sequence ' .. rec.f .. ' not found') end
    end)
    if not ok3 then return err end
    begin_free(rec, stats)
    local _, gone = release_tail(rec, p.budget, got.num_blocks, bs, true)
    complete = gone
  elseif e.kind == FORK then
    local cf = field_of(e.child)
    local ok3, child = guarded(function()
      if rec.st ~= '' then refuse('sequence ' .. rec.f .. ' not found') end
      local cmeta = redis.call('HGET', K_SEQS, cf)
      local c = cmeta and load_rec(cf, cmeta)
      if c then
        local run = run_get(cf)
        if c.st ~= 's' or not run or run.kind ~= 'fork' or run.parent ~= rec.f or c.l ~= lease then
          refuse('sequence ' .. cf .. ' exists already')
        end
        return {rec = c, run = run}
      end
      set_length(rec, e.num_tokens, bs)
      if e.child < 1 or e.child > (tonumber(redis.call('HGET', K_META, 'next_seq')) or 0) then
        refuse('sequence number ' .. cf .. ' was never granted')
      end
      c = {f = cf, l = lease, t = rec.t, c = rec.c, h = rec.h, k = rec.k, st = 's', pages = {}, nb = 0, add = {}}
      return {rec = c, run = {lease = lease, left = 0, kind = 'fork', parent = rec.f, pnb = rec.nb}, new = true}
    end)
    if not ok3 then return child end
    if child.new then
      redis.call('HSET', K_SEQS, rec.f, meta_string(rec))     -- (its length, as the entry says)
      redis.call('ZADD', K_LSEQ, 0, lease .. ':' .. cf)
    end
    local c, run = child.rec, child.run
    local blocks = plan_copy(c, rec, run.pnb, p.budget)
    complete = c.nb + #blocks >= run.pnb
    if complete then
      c.st = ''
      run_end(cf, run)
      stats.sequences_created = 1
    else
      run_set(cf, run)
    end
    write_copy(c, blocks, got.num_blocks, stats, held_load(lease, p.tenant))
  else
    return error_reply({code = 'INVALID_ARGUMENT', message = 'journal entry ' .. entry_no .. ': only a FORK or a ' ..
      'FREE is applied in parts'})
  end
  local applied, reserved = lease_progress(lease)
  if complete then
    applied = applied + 1
    set_lease_progress(lease, applied, reserved)
    stats.journal_entries = 1
  end
  stats.journal_batches = 1
  changed()
  incr_stats(stats)
  out.applied, out.num_reserved = applied, reserved
  return reply(out)
end

if p.part then return entry_part() end

-- ------------------------------------------------------------------ plan, then write

local ok, plan = guarded(function()
  local epoch, num_blocks, bs, attach = check_sync_target(p)
  local applied, reserved = lease_progress(lease)
  local first = p.first_entry
  local J = p.journal
  local n = J.n
  local done = 0
  if n > 0 then
    stats.journal_batches = 1
    if first > applied + 1 then
      stats.journal_gaps = 1
    else
      stats.journal_resent_entries = math.min(n, applied + 1 - first)
    end
  end
  local entries = {}
  if n > 0 and first <= applied + 1 then entries = entry_views(J, applied + 2 - first) end
  -- Read up front, one call each: who holds the blocks the entries take and the returned
  -- ones in reserve, the records of every sequence the entries name, and which of their
  -- commits' hashes are cached already.
  local rfields = {}
  for _, e in ipairs(entries) do
    for _, b in ipairs(e.blocks) do rfields[#rfields + 1] = D[b] or dec(b) end
  end
  for _, b in ipairs(p.returned) do rfields[#rfields + 1] = D[b] or dec(b) end
  if #rfields > 0 then
    local owners = hmget_chunked(K_RESERVE, rfields)
    for i, f in ipairs(rfields) do
      if owners[i] == lease then mine[tonumber(f)] = true end
    end
  end
  if #entries > 0 then
    local fields, seen, hashes = {}, {}, {}
    for _, e in ipairs(entries) do
      local f = field_of(e.sequence)
      if not seen[f] then seen[f] = true; fields[#fields + 1] = f end
      for _, h in ipairs(e.commits) do hashes[#hashes + 1] = h end
    end
    local metas = hmget_chunked(K_SEQS, fields)
    local lasts = {}
    for i, f in ipairs(fields) do
      if metas[i] then stored[f] = load_rec(f, metas[i]) end
    end
    load_last_pages(stored)
    for _, rec in pairs(stored) do
      if rec.nb > 0 and rec.l == lease then lasts[#lasts + 1] = rec_block(rec, rec.nb) end
    end
    load_refs(lasts)   -- the last blocks: whether a write must copy them first
    if #hashes > 0 then
      local got = hmget_chunked(K_H2B, hashes)
      for i, h in ipairs(hashes) do known[h] = got[i] or false end
      -- the blocks the commits name, where the records say they are (each sequence's
      -- commits continue from its committed blocks)
      local blocks, bfields, committed = {}, {}, {}
      for _, e in ipairs(entries) do
        local f = field_of(e.sequence)
        local rec = stored[f]
        if rec and #e.commits > 0 then
          local c = committed[f] or rec.c
          for j = 1, #e.commits do
            if c + j <= rec.nb then
              local b = rec_block(rec, c + j)
              if not blocks[b] then blocks[b] = true; bfields[#bfields + 1] = D[b] or dec(b) end
            end
          end
          committed[f] = c + #e.commits
        end
      end
      if #bfields > 0 then
        local cur = hmget_chunked(K_B2H, bfields)
        for i, s in ipairs(bfields) do hashed_before[tonumber(s)] = cur[i] or false end
      end
    end
    for i, e in ipairs(entries) do
      entry_no = applied + i
      apply_entry(e, bs)
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
  return {epoch = epoch, num_blocks = num_blocks, attach = attach, kept = reserved + reserve_delta - #p.returned,
          reserved = reserved, applied = applied + done, done = done}
end)
if not ok then return plan end

if plan.done > 0 then
  write_journal()
  stats.journal_entries = plan.done
end
if #p.returned > 0 then
  local fields = {}
  for i, b in ipairs(p.returned) do fields[i] = D[b] or dec(b) end
  call_chunked('HDEL', K_RESERVE, fields)
  call_chunked('RPUSH', K_FREE, fields)
end
-- The refill, sized after the journal and the returns are written (the blocks they freed
-- count as available). A refill towards the reserve's size takes free blocks only (it
-- does not evict the prefix cache for blocks no step needs yet); what a step needs at
-- once (p.need) may evict. A refill takes at most p.max_refill blocks per call (the next
-- Sync takes more): its cost is per block, and a large pool's cap is large.
-- The lease's holdings (lib/held) after the journal and the returns: its tables' change
-- (a fork's child was counted when its number was granted) and its reserve's.
local held = held_load(lease, p.tenant)
local held_blocks, held_seqs = plan.kept - plan.reserved, 0
if plan.done > 0 then
  for f, rec in pairs(recs) do
    if rec then
      held_blocks = held_blocks + (gone[f] and 0 or rec_len(rec)) - (born[f] and 0 or rec.nb)
      if gone[f] then held_seqs = held_seqs - 1 end
    end
  end
end
local quota_cut, quota_limit = '', 0
local available = available_now(plan.num_blocks)
local cap = p.cap
if available < p.pressure_blocks then cap = math.min(cap, p.pressure_cap) end
local unused = math.min(available, redis.call('LLEN', K_FREE) + plan.num_blocks -
                                  (tonumber(redis.call('HGET', K_STATE, 'fresh')) or 0))
local need = math.max(math.min(unused, p.max_refill, math.max(0, math.min(p.want, cap) - plan.kept)),
                      math.min(available, p.max_need, math.max(0, p.need - plan.kept)))
local room = held_room(held, 'blocks', p.quota, held_blocks)
if need > room then
  need = room
  if p.need - plan.kept > room then quota_cut, quota_limit = 'blocks', p.quota.blocks end
end
local granted = {}
if need > 0 then
  local moved = {}
  granted = take_blocks(need, plan.num_blocks, dups, moved, stats)
  for _, m in ipairs(moved) do
    local s = D[m[2]] or dec(m[2])
    redis.call('HSET', K_H2B, m[1], s)
    redis.call('HSET', K_B2H, s, m[1])
  end
  local add = {}
  for _, b in ipairs(granted) do add[#add + 1] = D[b] or dec(b); add[#add + 1] = lease end
  call_chunked('HSET', K_RESERVE, add, 2)
  stats.blocks_allocated = #granted
end
if plan.done > 0 or plan.kept + #granted ~= plan.reserved then
  set_lease_progress(lease, plan.applied, plan.kept + #granted)
end
local first_seq, num_seqs = 0, 0
if p.want_sequence_numbers > 0 then
  num_seqs = math.min(p.want_sequence_numbers, held_room(held, 'sequences', p.quota, held_seqs))
  if num_seqs < p.want_sequence_numbers and quota_cut == '' then
    quota_cut, quota_limit = 'sequences', p.quota.sequences
  end
  if num_seqs > 0 then
    first_seq = redis.call('HINCRBY', K_META, 'next_seq', num_seqs) - num_seqs + 1
    grant_numbers(lease, first_seq, num_seqs)
  end
end
held_write(held, held_blocks + #granted, held_seqs + num_seqs)
if plan.attach then extend_lease(lease, p.lease_left_ms, now_ms()) end
local serial
if plan.done > 0 or #p.returned > 0 or #granted > 0 or num_seqs > 0 or plan.attach then
  serial = changed()
else
  serial = tonumber(redis.call('HGET', K_STATE, 'version')) or 0
end
incr_stats(stats)
return remember(K_REQUEST, p, reply({epoch = plan.epoch, generation = gen, applied = plan.applied, granted = granted,
                                    num_reserved = plan.kept + #granted, cap = cap,
                                    first_sequence_number = first_seq, num_sequence_numbers = num_seqs,
                                    quota = quota_cut, quota_limit = quota_limit,
                                    tier_orders = TIER.orders, serial = serial}))
