--- reap: frees the sequences and the reserves of expired leases (or of one revoked lease,
--- force_lease), a bounded number per call; idempotent, so every replica may run it.
---
--- KEYS[1..16]: the pool's keys (kvservice/allocator/keys.py).
--- ARGV[1]: msgpack map {pool, force_lease ('' or a lease id to expire now), max_leases,
---   max_seqs, max_blocks (the freed sequences' blocks in all: past it, the rest waits for
---   the next call; one sequence at least; what is left of it, 256 at least, bounds the
---   scan of the reserve hash for an ended lease's reserve), tombstone_ms}
--- Returns msgpack {epoch, leases (expired leases fully reaped), sequences (sequences
---   freed), reserved (reserve blocks reclaimed), more (whether work is left)}; or an
---   error (lib/codec): NOT_FOUND.
--- @include "lib/time"
--- @include "lib/refs"
--- @include "lib/reserve"
--- @include "lib/held"

local p = args()
local ok, res = guarded(function()
  local epoch, num_blocks = pool_meta(p.pool)
  return {epoch = epoch, num_blocks = num_blocks}
end)
if not ok then return res end
local now = now_ms()
if p.force_lease ~= '' and redis.call('ZSCORE', K_LEASES, p.force_lease) then
  redis.call('ZADD', K_LEASES, 0, p.force_lease)
end
local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, p.max_leases)
local budget = p.max_seqs
local block_budget = p.max_blocks   -- the blocks of the freed sequences, in all
local nseqs, nleases, more, reserved = 0, 0, false, 0
local del, lseq_del = {}, {}
for _, lease in ipairs(expired) do
  if budget <= 0 then more = true; break end
  local members = redis.call('ZRANGEBYLEX', K_LSEQ, '[' .. lease .. ':', '(' .. lease .. ';', 'LIMIT', 0, budget + 1)
  local take = math.min(#members, budget)
  if take > 0 then
    local ns = {}
    for i = 1, take do ns[i] = string.sub(members[i], #lease + 2) end
    local metas = hmget_chunked(K_SEQS, ns)
    local tabs = hmget_chunked(K_TABS, ns)
    local recs, blocks = {}, {}
    local done = 0
    for i = 1, take do
      -- the block budget: always one sequence, then as many as fit
      local nb = metas[i] and #(tabs[i] or '') / W or 0
      if done > 0 and nb > block_budget then break end
      done = i
      lseq_del[#lseq_del + 1] = members[i]
      if metas[i] then
        local rec = load_rec(metas[i], tabs[i])
        recs[#recs + 1] = rec
        for _, b in ipairs(rec_blocks(rec)) do blocks[#blocks + 1] = b end
        del[#del + 1] = ns[i]
        block_budget = block_budget - nb
      end
    end
    load_refs(blocks)
    local nrefs = 0
    for _, rec in ipairs(recs) do release(rec); nrefs = nrefs + rec_len(rec) end
    held_write(held_load(lease), -nrefs, -#recs)
    nseqs = nseqs + #recs
    if done < take then budget = 0 else budget = budget - take end
    take = done
  end
  if #members > take then
    more = true
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
      redis.call('HDEL', K_STATE, 'resync:' .. lease)   -- (a resync it left unfinished)
      held_drop(lease)
    else
      held_write(held_load(lease), -got, 0)
      more = true
      break
    end
  end
end
if #expired == p.max_leases then more = true end
if #del > 0 then
  call_chunked('HDEL', K_SEQS, del)
  call_chunked('HDEL', K_TABS, del)
end
if #lseq_del > 0 then call_chunked('ZREM', K_LSEQ, lseq_del) end
local stats = {leases_expired = nleases, sequences_reaped = nseqs, sequences_freed = nseqs}
apply(res.num_blocks, zero_hashed(nil), stats, nil)
redis.call('ZREMRANGEBYSCORE', K_DEAD, '-inf', now - p.tombstone_ms)
if #expired > 0 then changed() end
incr_stats(stats)
return reply({epoch = res.epoch, leases = nleases, sequences = nseqs, reserved = reserved, more = more})
