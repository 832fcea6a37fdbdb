--- resync: a lease's whole state in one pool, as its client holds it, sent after a Sync
--- reply showed that the pool lost journal entries the client had seen acknowledged
--- (Redis lost writes: restarted from an older snapshot or AOF, or a failover to a replica
--- that lagged). The pool keeps what it can prove is the lease's and reports the rest
--- lost; the lease's journal then continues from first_entry.
---
--- Each claimed sequence is checked block by block against who holds what now. A block is
--- kept when it is the lease's alone (in the lease's reserve, or in one of the lease's
--- recorded tables, and no other lease references it), or when it is a full committed
--- block whose hash in the pool is the one the client sends (content-addressed, shared
--- read-only; an evictable one is revived). Anything else (a free block: it may have been
--- handed out and written since; another lease's block; a block under another hash) makes
--- the sequence lost, as does a sequence number the pool may have given to another lease
--- (recorded for another lease, or absent but not above the pool's last granted number).
--- So no writable block is ever in two leases' tables. The lease's recorded sequences
--- that are not claimed (freed in the lost writes) or lost are dropped; reference counts
--- become the other leases' plus the kept tables'; the commits of kept blocks that the pool
--- lost are registered again (unless the hash is held by another block: then the block
--- stays unhashed, as a duplicate); the lease's reserve is what the pool has in it, minus
--- the blocks the kept tables hold.
---
--- KEYS[1..16]: the pool's keys (kvservice/allocator/keys.py); KEYS[17]: the request key.
--- ARGV[1]: msgpack map {pool, epoch, request_id ('': none), fingerprint, request_ttl_ms,
---   lease_id, tenant (the lease's, for lib/held), lease_deadline_ms (0: attached to the pool already), touch_deadline_ms (the
---   lease's deadline after the Sync's keep-alive, raised here as lease_touch does; 0: none), first_entry, cap,
---   claims = [{n, t (num_tokens), tab = [block ids], c (committed blocks), h (the last
---   hash, hex), hs = [the hash hex of each committed block], k (cached tokens)}]}
--- Returns msgpack {epoch, applied (first_entry - 1), lost = [sequence numbers],
---   reserve = [the lease's reserved blocks], cap}; or an error (lib/codec): NOT_FOUND,
---   FAILED_PRECONDITION (reasons EPOCH_CHANGED, LEASE_EXPIRED), and the internal
---   LEASE_UNKNOWN.
--- @include "lib/request"
--- @include "lib/refs"
--- @include "lib/reserve"
--- @include "lib/held"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
touch_lease(p)
local prev = replay(K_REQUEST, p)
if prev then return prev end
local lease = p.lease_id

local function field_of(n)
  return string.format('%d', n)
end

local function add_block(list, seen, b)
  if not seen[b] then seen[b] = true; list[#list + 1] = b end
end

local ok, plan = guarded(function()
  local epoch, _, bs, attach = check_sync_target(p)
  -- What the pool says the lease holds: its records (and their references) and its reserve.
  local members = redis.call('ZRANGEBYLEX', K_LSEQ, '[' .. lease .. ':', '(' .. lease .. ';')
  local old, old_fields, old_refs = {}, {}, {}
  for i, m in ipairs(members) do old_fields[i] = string.sub(m, #lease + 2) end
  if #old_fields > 0 then
    local metas, tabs = hmget_chunked(K_SEQS, old_fields), hmget_chunked(K_TABS, old_fields)
    for i, f in ipairs(old_fields) do
      if metas[i] then
        local blocks = rec_blocks(load_rec(metas[i], tabs[i]))
        old[f] = blocks
        for _, b in ipairs(blocks) do old_refs[b] = (old_refs[b] or 0) + 1 end
      end
    end
  end
  local reserved = {}
  local all = redis.call('HGETALL', K_RESERVE)
  for i = 1, #all, 2 do
    if all[i + 1] == lease then reserved[tonumber(all[i])] = true end
  end
  -- The counts and hashes of every block claimed or held by the lease's records, and who
  -- holds the claimed sequence numbers.
  local blocks, seen = {}, {}
  for _, c in ipairs(p.claims) do
    for _, b in ipairs(c.tab) do add_block(blocks, seen, b) end
  end
  for b in pairs(old_refs) do add_block(blocks, seen, b) end
  local bfields = {}
  for i, b in ipairs(blocks) do bfields[i] = D[b] or dec(b) end
  local cnt, hash_of = {}, {}
  if #bfields > 0 then
    local rs, hs = hmget_chunked(K_REF, bfields), hmget_chunked(K_B2H, bfields)
    for i, b in ipairs(blocks) do cnt[b] = tonumber(rs[i]) or 0; hash_of[b] = hs[i] or false end
  end
  local nfields = {}
  for i, c in ipairs(p.claims) do nfields[i] = field_of(c.n) end
  local holders = hmget_chunked(K_SEQS, nfields)
  local next_seq = tonumber(redis.call('HGET', K_META, 'next_seq')) or 0

  -- Which claims hold.
  local kept, lost, kept_fields = {}, {}, {}
  for i, c in ipairs(p.claims) do
    local f = nfields[i]
    local mine = old[f]
    local ok_seq = not kept_fields[f] and (mine ~= nil or (holders[i] == false and c.n > next_seq))
    if ok_seq and holders[i] and not mine then ok_seq = false end   -- another lease's number
    if ok_seq then
      for j, b in ipairs(c.tab) do
        local others = math.max(0, cnt[b] - (old_refs[b] or 0))
        local h = hash_of[b]
        local committed = j <= c.c
        local good
        if others == 0 and ((old_refs[b] or 0) > 0 or reserved[b]) then
          good = not h or (committed and h == c.hs[j])      -- the lease's block, same content
        else
          good = committed and h and h == c.hs[j]           -- shared read-only, or evictable
        end
        if not good then ok_seq = false; break end
      end
    end
    if ok_seq then
      kept[#kept + 1] = c
      kept_fields[f] = true
    else
      lost[#lost + 1] = c.n
    end
  end
  return {epoch = epoch, bs = bs, attach = attach, old = old, old_refs = old_refs, reserved = reserved,
          cnt = cnt, hash_of = hash_of, kept = kept, kept_fields = kept_fields, lost = lost, next_seq = next_seq}
end)
if not ok then return plan end

-- The new counts: the other leases' references plus the kept tables'.
local new_refs = {}
for _, c in ipairs(plan.kept) do
  for _, b in ipairs(c.tab) do new_refs[b] = (new_refs[b] or 0) + 1 end
end
local touched = {}
for b in pairs(plan.old_refs) do touched[b] = true end
for b in pairs(new_refs) do touched[b] = true end
local w = changes()
for b in pairs(touched) do
  local s = D[b] or dec(b)
  local before = plan.cnt[b]
  local after = before - (plan.old_refs[b] or 0) + (new_refs[b] or 0)
  if after > 0 then
    if after ~= before then w.set_ref[#w.set_ref + 1] = s; w.set_ref[#w.set_ref + 1] = D[after] or dec(after) end
    if plan.reserved[b] then w.unreserve[#w.unreserve + 1] = s; plan.reserved[b] = nil end
    if before == 0 and plan.hash_of[b] then w.revive[#w.revive + 1] = s end
  elseif before > 0 then
    w.del_ref[#w.del_ref + 1] = s
    park(w, s, plan.hash_of[b])
  end
end
write_changes(w)

-- The commits the pool lost: registered again where the hash is free.
local reg_b, reg_h = {}, {}
for _, c in ipairs(plan.kept) do
  for j = 1, c.c do
    local b = c.tab[j]
    if not plan.hash_of[b] and not reg_b[b] then reg_b[b] = true; reg_h[#reg_h + 1] = {c.hs[j], b} end
  end
end
if #reg_h > 0 then
  local hs = {}
  for i, x in ipairs(reg_h) do hs[i] = x[1] end
  local got = hmget_chunked(K_H2B, hs)
  local h2b, b2h, taken = {}, {}, {}
  for i, x in ipairs(reg_h) do
    if not got[i] and not taken[x[1]] then
      taken[x[1]] = true
      local s = D[x[2]] or dec(x[2])
      h2b[#h2b + 1] = x[1]; h2b[#h2b + 1] = s
      b2h[#b2h + 1] = s; b2h[#b2h + 1] = x[1]
    end
  end
  write_hashes(h2b, b2h)
end

-- The records: the kept claims as the client holds them; the lease's others dropped.
local put_meta, put_tab, del, lseq_add, lseq_del = {}, {}, {}, {}, {}
local created, freed, top = 0, 0, plan.next_seq
for _, c in ipairs(plan.kept) do
  local f = field_of(c.n)
  put_meta[#put_meta + 1] = f
  put_meta[#put_meta + 1] = meta_string({l = lease, t = c.t, c = c.c, k = c.k, h = c.h})
  put_tab[#put_tab + 1] = f; put_tab[#put_tab + 1] = hexids(c.tab)
  if not plan.old[f] then
    lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. f
    created = created + 1
    if c.n > top then top = c.n end
  end
end
for f in pairs(plan.old) do
  if not plan.kept_fields[f] then
    del[#del + 1] = f
    lseq_del[#lseq_del + 1] = lease .. ':' .. f
    freed = freed + 1
  end
end
write_records(put_meta, put_tab, del, lseq_add, lseq_del)
if top > plan.next_seq then redis.call('HSET', K_META, 'next_seq', top) end

local reserve = {}
for b in pairs(plan.reserved) do reserve[#reserve + 1] = b end
table.sort(reserve)
set_lease_progress(lease, p.first_entry - 1, #reserve)
-- Its holdings, counted again: the kept tables and the reserve; the sequence numbers it
-- was granted and has not used stay counted.
local h = held_load(lease, p.tenant)
local nblocks, nold = #reserve, 0
for _, c in ipairs(plan.kept) do nblocks = nblocks + #c.tab end
for _ in pairs(plan.old) do nold = nold + 1 end
local nseqs = #plan.kept + math.max(0, h.ls - nold)
held_write(h, nblocks - h.lb, nseqs - h.ls)
if plan.attach then redis.call('ZADD', K_LEASES, 'GT', p.lease_deadline_ms, lease) end
changed()
incr_stats({journal_resyncs = 1, sequences_lost = #plan.lost, sequences_created = created,
            sequences_freed = freed})
return remember(K_REQUEST, p, reply({epoch = plan.epoch, applied = p.first_entry - 1, lost = plan.lost,
                                    reserve = reserve, cap = p.cap}))
