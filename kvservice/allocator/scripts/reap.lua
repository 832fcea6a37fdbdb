--- reap: frees the sequences and the reserves of expired leases (or of one revoked lease,
--- force_lease), a bounded number per call, and releases the read pins past their deadline
--- (lib/pins); idempotent, so every replica may run it.
--- Records that runs were building or freeing go with them (lib/runs: a run's admission
--- goes back to the pool; a staged create's new blocks lose the hashes it registered). A
--- sequence longer than what is left of the call's block budget is freed from its last
--- block, that many blocks per call (it is then in state "f" until it is gone).
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, force_lease ('' or a lease id to expire now), max_leases,
---   max_seqs, max_blocks (the freed sequences' blocks in all: past it, the rest waits for
---   the next call; what is left of it, 256 at least, bounds the scan of the reserve hash
---   for an ended lease's reserve), tombstone_ms}
--- Returns msgpack {epoch, leases (expired leases fully reaped), sequences (sequences
---   freed), reserved (reserve blocks reclaimed), pins (pins released), more (whether work
---   is left), next_ms (time left until the earliest lease or pin deadline in the pool
---   passes, 0 if it has; -1: no lease or pin there)}; or an error (lib/codec): NOT_FOUND.
--- @include "lib/time"
--- @include "lib/runs"

local p = args()
local ok, res = guarded(function()
  local epoch, num_blocks, bs = pool_meta(p.pool)
  return {epoch = epoch, num_blocks = num_blocks, bs = bs}
end)
if not ok then return res end
local now = now_ms()
local pins_swept = PINS.sweep(now)
if p.force_lease ~= '' and redis.call('ZSCORE', K_LEASES, p.force_lease) then
  redis.call('ZADD', K_LEASES, 0, p.force_lease)
end
local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, p.max_leases)
local budget = p.max_seqs
local block_budget = p.max_blocks   -- the blocks of the freed sequences, in all
local nseqs, nleases, more, reserved = 0, 0, false, 0
local del, del_tab, lseq_del = {}, {}, {}
local stats = {}
local long = nil                      -- a long record: freed in part, alone, after the loop

-- A record about to be dropped: its run ends; a staged create's new blocks lose their
-- hashes (their content was never computed).
local function unstage(rec)
  if rec.st == 's' then
    local run = run_get(rec.f)
    if run then run_end(rec.f, run) end
    if run and run.kind == 'create' then rec.st = 'd' end
  end
  if rec.st == 'd' then unhash(rec, rec.k / res.bs + 1) end
end

for _, lease in ipairs(expired) do
  if budget <= 0 then more = true; break end
  local members = redis.call('ZRANGEBYLEX', K_LSEQ, '[' .. lease .. ':', '(' .. lease .. ';', 'LIMIT', 0, budget + 1)
  local take = math.min(#members, budget)
  if take > 0 then
    local ns = {}
    for i = 1, take do ns[i] = string.sub(members[i], #lease + 2) end
    local metas = hmget_chunked(K_SEQS, ns)
    local recs, blocks = {}, {}
    local done = 0
    local nrefs, nlive, nheld = 0, 0, 0
    for i = 1, take do
      local rec = metas[i] and load_rec(ns[i], metas[i])
      local nb = rec and rec.nb or 0
      if nb > block_budget then
        -- (longer than what is left: freed in part, alone, if it is the call's first)
        if done == 0 and nseqs == 0 and #del == 0 then long = rec end
        break
      end
      done = i
      lseq_del[#lseq_del + 1] = members[i]
      if rec then
        unstage(rec)
        load_all_pages(rec)
        recs[#recs + 1] = rec
        for _, b in ipairs(rec_blocks(rec)) do blocks[#blocks + 1] = b end
        drop_record(rec, del, del_tab)
        block_budget = block_budget - nb
        nrefs = nrefs + nb
        if rec.st == '' then nlive = nlive + 1 end
        if rec.st == '' or rec.st == 's' then nheld = nheld + 1 end
      end
    end
    load_refs(blocks)
    for _, rec in ipairs(recs) do release(rec) end
    if #recs > 0 then held_write(held_load(lease), -nrefs, -nheld) end
    nseqs = nseqs + nlive
    if done < take then budget = 0 else budget = budget - take end
    take = done
  end
  if long or #members > take then
    more = true
    if long then break end
  else
    -- Its sequences are freed: the lease is dead (the workers learn it from K_DEAD at
    -- once); it leaves the pool's leases once its reserve is back too (a scan of the
    -- pool's reserve hash, bounded per call).
    if not redis.call('ZSCORE', K_DEAD, lease) then redis.call('ZADD', K_DEAD, now, lease) end
    local got, done = reclaim_reserve(lease, math.max(256, block_budget))
    reserved = reserved + got
    if done then
      redis.call('ZREM', K_LEASES, lease)
      nleases = nleases + 1
      redis.call('HDEL', K_JOURNAL, lease)
      redis.call('HDEL', K_STATE, 'resync:' .. lease, 'numbers:' .. lease)   -- (a resync it left unfinished)
      held_drop(lease)
    else
      held_write(held_load(lease), -got, 0)
      more = true
      break
    end
  end
end
if #expired == p.max_leases then more = true end
write_records({}, {}, del, del_tab, {}, lseq_del)
stats.leases_expired = nleases
stats.sequences_reaped = nseqs
stats.sequences_freed = nseqs
if long then
  -- A long record, alone in this call: freed from its last block, a part.
  if long.st == '' then
    stats.sequences_reaped = stats.sequences_reaped + 1
    stats.sequences_freed = stats.sequences_freed + 1
    nseqs = nseqs + 1
    held_write(held_load(long.l), 0, -1)
  elseif long.st == 's' then
    held_write(held_load(long.l), 0, -1)
  end
  unstage(long)
  if long.st ~= 'd' then long.st = 'f' end
  release_tail(long, math.max(p.max_blocks, 1), res.num_blocks, res.bs, false)
else
  apply(res.num_blocks, zero_hashed(nil), stats, nil)
end
redis.call('ZREMRANGEBYSCORE', K_DEAD, '-inf', now - p.tombstone_ms)
if #expired > 0 or pins_swept > 0 then changed() end
stats.fetch_pins_expired = pins_swept
incr_stats(stats)
local first = redis.call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
local next_ms = first[2] and math.max(tonumber(first[2]) - now, 0) or -1
local pin_due = PINS.next_deadline()
if pin_due and (next_ms < 0 or pin_due - now < next_ms) then next_ms = math.max(pin_due - now, 0) end
return reply({epoch = res.epoch, leases = nleases, sequences = nseqs, reserved = reserved, pins = pins_swept,
              more = more, next_ms = next_ms})
