--- resync: a lease's whole state in one pool, as its client holds it, sent after a Sync
--- reply showed that the pool lost journal entries the client had seen acknowledged
--- (Redis lost writes: restarted from an older snapshot or AOF, or a failover to a replica
--- that lagged). The pool keeps what it can prove is the lease's and reports the rest
--- lost; the lease's journal then continues from first_entry.
---
--- A resync runs in parts, each one call of bounded work (about ``budget`` blocks), so
--- that no call stalls Redis however much the lease holds; every part leaves the pool
--- consistent (counts, records, reserves, holdings). From the first part to the last, the
--- lease's records in the pool are the resync's alone: K_STATE "resync:<lease>" names the
--- run, and every other call of the lease there fails (lib/pool, lease_in_pool). The
--- run's own state is K_RUN (KEYS[31], a hash: run, generation, stage, next, lost, "n<number>" for
--- the lease's recorded sequences, round (raised by each first part), "b<round>:<block>" for
--- blocks the round took from the reserve), which expires after request_ttl_ms. The pool's counters see the lease's recorded sequences
--- freed and its kept claims created. Stages:
---   drop     the lease's recorded sequences are dropped (as a free, last block first),
---            except that a block whose count reaches 0 and has no hash joins the lease's
---            reserve: the lease's alone, it waits for a claim;
---   claims   each claim is checked block by block against who holds what now. A block
---            is kept when it is the lease's alone (in its reserve, or taken from it by
---            an earlier claim of this run) and has no hash, or when it is a full
---            committed block whose hash in the pool is the one the client sends
---            (content-addressed, shared read-only; an evictable one is revived).
---            Anything else (a free block: it may have been handed out and written since;
---            another lease's block; a block under another hash) makes the sequence lost,
---            as does a sequence number the pool may have given to another lease (held
---            now, or neither recorded for the lease, nor granted to it for its local
---            forks (lib/reserve), nor above the pool's last granted number).
---            So no writable block is ever in two leases' tables. A kept claim is
---            recorded as the client holds it, and the commits of its blocks that the pool
---            lost are registered again (unless the hash is held by another block: the
---            block stays unhashed, as a duplicate);
---   reclaim  the lease's reserve goes back to the free list (the next Sync refills it);
---   finish   the journal continues from first_entry; the run ends.
--- The first part (part 0) starts a run afresh, ending any earlier one of the lease
--- (whose parts then fail with RESYNC_SUPERSEDED; the numbers it dropped stay the lease's); each later part continues the run it
--- names. The caller sends the claims in slices: ``offset`` is the index of the slice's
--- first claim, which must be the run's next (else the reply only says which is next). A
--- claim of more than ``budget`` blocks is sent alone, in pieces (``piece``: its blocks
--- from ``from`` on, ``blocks`` in all), each checked and taken into a staged record of the
--- claimed number (lib/runs), the last one making it the sequence; a piece that finds a
--- block the lease cannot keep makes it lost and gives back what the earlier pieces took.
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31]: the request key;
--- KEYS[31]: the run's key (keys.resync_key).
--- ARGV[1]: msgpack map {pool, epoch, request_id ('': none), fingerprint, request_ttl_ms,
---   lease_id, tenant (the lease's, for lib/held), lease_left_ms (its time left, ms; 0:
---   attached to the pool already), touch_left_ms (its time left after the Sync's keep-alive,
---   raised here as lease_touch does; 0: none), first_entry, cap, run (the run's id),
---   part (0: the first), budget (blocks of work per part), total (claims in all),
---   offset, claims = [{n, t (num_tokens), tab = [block ids], c (committed blocks), h (the
---   last hash, hex), hs = [the hash hex of each committed block], k (cached tokens)}],
---   piece, from, blocks (a long claim's piece: its tab and hs from block ``from`` on, of
---   ``blocks`` in all)}
--- Returns msgpack {epoch, generation, done = false, next (the index of the next claim to send), from
---   (the first block of its next piece)} while
---   the run goes on; {epoch, generation, done = true, applied (first_entry - 1), lost = [sequence
---   numbers], reserve = [] (the lease's reserve, given back), cap} when it is done (kept
---   under the request id); or an error (lib/codec): NOT_FOUND, FAILED_PRECONDITION
---   (reasons EPOCH_CHANGED, LEASE_EXPIRED, RESYNC_SUPERSEDED, ROLLED_BACK: the pool began a
---   generation since the run's first part), and the internal
---   LEASE_UNKNOWN.
--- @include "lib/request"
--- @include "lib/runs"

local K_REQUEST, K_RUN = KEYS[NUM_POOL_KEYS + 1], KEYS[NUM_POOL_KEYS + 2]
local p = args()
touch_lease(p)
local prev = replay(K_REQUEST, p)
if prev then return prev end
local lease = p.lease_id
local MARK = 'resync:' .. lease

local ok, target = guarded(function()
  local epoch, _, _, attach, gen = check_sync_target(p, true)
  if p.part > 0 and (redis.call('HGET', K_STATE, MARK) ~= p.run or redis.call('HGET', K_RUN, 'run') ~= p.run) then
    bad('FAILED_PRECONDITION', 'the resync of lease ' .. lease .. ' in pool ' .. p.pool .. ' was superseded by ' ..
      'another one, or its parts came too far apart; start it again', {reason = 'RESYNC_SUPERSEDED'})
  end
  if p.part > 0 and tonumber(redis.call('HGET', K_RUN, 'generation')) ~= gen then
    bad('FAILED_PRECONDITION', 'pool ' .. p.pool .. ' began generation ' .. string.format('%d', gen) ..
      ' during the resync of lease ' .. lease .. ' (its Redis restarted or failed over); start it again',
      {reason = 'ROLLED_BACK', generation = gen})
  end
  if attach then extend_lease(lease, p.lease_left_ms, now_ms()) end
  return {epoch = epoch, generation = gen}
end)
if not ok then return target end
local epoch, gen = target.epoch, target.generation

if p.part == 0 then
  -- A run started again (a part's answer lost, a resync sent again) keeps the numbers of
  -- the sequences an earlier run of the lease dropped in this generation ("n<number>":
  -- they are the lease's, and its claims name them), not the blocks it took (a new
  -- round: "b<round>:<block>").
  if tonumber(redis.call('HGET', K_RUN, 'generation')) ~= gen then redis.call('DEL', K_RUN) end
  redis.call('HDEL', K_RUN, 'from')
  redis.call('HINCRBY', K_RUN, 'round', 1)
  redis.call('HSET', K_RUN, 'run', p.run, 'stage', 'drop', 'next', 0, 'lost', '', 'generation', gen)
  redis.call('HSET', K_STATE, MARK, p.run)
end
redis.call('PEXPIRE', K_RUN, p.request_ttl_ms)
local B = 'b' .. redis.call('HGET', K_RUN, 'round') .. ':'

local budget = p.budget
local held = held_load(lease, p.tenant)
local applied, reserved = lease_progress(lease)
local stats = {}

-- Drops recorded sequences of the lease, about ``budget`` blocks of them (one at least);
-- returns the work done and whether none is left.
local function drop()
  local members = redis.call('ZRANGEBYLEX', K_LSEQ, '[' .. lease .. ':', '(' .. lease .. ';', 'LIMIT', 0, 64)
  if #members == 0 then return 1, true end
  local ns = {}
  for i, m in ipairs(members) do ns[i] = string.sub(m, #lease + 2) end
  local metas = hmget_chunked(K_SEQS, ns)
  local recs, blocks, del, del_tab, lseq_del, olds, work = {}, {}, {}, {}, {}, {}, 0
  for i, f in ipairs(ns) do
    local rec = metas[i] and load_rec(f, metas[i])
    local nb = rec and rec.nb or 0
    if #lseq_del > 0 and work + nb > budget then break end
    lseq_del[#lseq_del + 1] = members[i]
    if rec then
      load_all_pages(rec)
      recs[#recs + 1] = rec
      for _, b in ipairs(rec_blocks(rec)) do blocks[#blocks + 1] = b end
      drop_record(rec, del, del_tab)
      olds[#olds + 1] = 'n' .. f; olds[#olds + 1] = 1
    end
    work = work + 1 + nb
  end
  load_refs(blocks)
  for _, rec in ipairs(recs) do release(rec) end
  -- Counts that reach 0: hashed blocks to the evictable set, the others to the reserve.
  local w = changes()
  local zb, zf = zeroed()
  local hashed = {}
  if #zf > 0 then
    local hs = hmget_chunked(K_B2H, zf)
    for i, b in ipairs(zb) do hashed[b] = hs[i] and true or false end
  end
  for b, r in pairs(refs) do
    local s = D[b] or dec(b)
    if r > 0 then
      if r ~= orig[b] then w.set_ref[#w.set_ref + 1] = s; w.set_ref[#w.set_ref + 1] = D[r] or dec(r) end
    else
      w.del_ref[#w.del_ref + 1] = s
      if hashed[b] then
        park(w, s, true)
      else
        w.reserve_add[#w.reserve_add + 1] = s; w.reserve_add[#w.reserve_add + 1] = lease
        reserved = reserved + 1
      end
    end
  end
  write_changes(w)
  write_records({}, {}, del, del_tab, {}, lseq_del)
  if #olds > 0 then call_chunked('HSET', K_RUN, olds, 2) end
  held_write(held, #w.reserve_add / 2 - #blocks, -#recs)
  stats.sequences_freed = #recs
  return work, #members == #lseq_del and #members < 64
end

-- Checks and records the claims of the slice from the run's next one, about ``left``
-- blocks of them (one at least); returns the work done and the index of the next claim.
local function claims(next, left)
  if p.offset ~= next then return 1, next end
  local todo, work = {}, 0
  for _, c in ipairs(p.claims) do
    if #todo > 0 and work + #c.tab > left then break end
    todo[#todo + 1] = c
    work = work + 1 + #c.tab
  end
  if #todo == 0 then return 1, next end
  -- Who holds what now: counts, hashes, the reserve, blocks the run took; the numbers.
  local blocks, bf = {}, {}
  local cnt = {}
  for _, c in ipairs(todo) do
    for _, b in ipairs(c.tab) do
      if cnt[b] == nil then cnt[b] = 0; blocks[#blocks + 1] = b; bf[#bf + 1] = D[b] or dec(b) end
    end
  end
  local rs, hs, res = hmget_chunked(K_REF, bf), hmget_chunked(K_B2H, bf), hmget_chunked(K_RESERVE, bf)
  local tf = {}
  for i, s in ipairs(bf) do tf[i] = B .. s end
  local tk = hmget_chunked(K_RUN, tf)
  local hash_of, in_reserve, mine = {}, {}, {}
  for i, b in ipairs(blocks) do
    cnt[b] = tonumber(rs[i]) or 0
    hash_of[b] = hs[i] or false
    in_reserve[b] = res[i] == lease
    mine[b] = in_reserve[b] or tk[i] ~= false
  end
  local nf, of = {}, {}
  for i, c in ipairs(todo) do nf[i] = string.format('%d', c.n); of[i] = 'n' .. nf[i] end
  local holders, old = hmget_chunked(K_SEQS, nf), hmget_chunked(K_RUN, of)
  local next_seq = tonumber(redis.call('HGET', K_META, 'next_seq')) or 0
  local granted = granted_numbers(lease)
  local top = next_seq
  local w = changes()
  local took, counted = {}, {}
  local put_meta, put_tab, lseq_add, lost = {}, {}, {}, {}
  local reg_b, reg_h = {}, {}
  local kept, nrefs = 0, 0
  for i, c in ipairs(todo) do
    local good = holders[i] == false and (old[i] ~= false or c.n > next_seq or granted(c.n))
    if good then
      for j, b in ipairs(c.tab) do
        local h = hash_of[b]
        if h then
          good = j <= c.c and h == c.hs[j]       -- shared read-only, or evictable
        else
          good = mine[b]                          -- the lease's alone
        end
        if not good then break end
      end
    end
    if good then
      for j, b in ipairs(c.tab) do
        local s = D[b] or dec(b)
        if cnt[b] == 0 then
          if hash_of[b] then
            w.revive[#w.revive + 1] = s
          elseif in_reserve[b] then
            in_reserve[b] = false
            w.unreserve[#w.unreserve + 1] = s
            took[#took + 1] = B .. s; took[#took + 1] = 1
          end
        end
        cnt[b] = cnt[b] + 1
        counted[b] = true
        if j <= c.c and not hash_of[b] and not reg_b[b] then reg_b[b] = true; reg_h[#reg_h + 1] = {c.hs[j], b} end
      end
      put_meta[#put_meta + 1] = nf[i]
      local rec = {f = nf[i], l = lease, t = c.t, c = c.c, k = c.k, h = c.h, st = '', pages = {}, nb = 0, add = c.tab,
                   new = true}
      put_meta[#put_meta + 1] = meta_string(rec)
      rec_page_writes(rec, nil, put_tab)
      lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. nf[i]
      kept, nrefs = kept + 1, nrefs + #c.tab
      if c.n > top then top = c.n end
    else
      lost[#lost + 1] = nf[i]
    end
  end
  for b in pairs(counted) do
    w.set_ref[#w.set_ref + 1] = D[b] or dec(b); w.set_ref[#w.set_ref + 1] = D[cnt[b]] or dec(cnt[b])
  end
  write_changes(w)
  reserved = reserved - #w.unreserve
  -- (a block the run took stays the lease's while it has no hash: for the claims after)
  if #took > 0 then call_chunked('HSET', K_RUN, took, 2) end
  -- The commits the pool lost: registered again where the hash is free.
  if #reg_h > 0 then
    local want = {}
    for k, x in ipairs(reg_h) do want[k] = x[1] end
    local got = hmget_chunked(K_H2B, want)
    local h2b, b2h, dup = {}, {}, {}
    for k, x in ipairs(reg_h) do
      if not got[k] and not dup[x[1]] then
        dup[x[1]] = true
        local s = D[x[2]] or dec(x[2])
        h2b[#h2b + 1] = x[1]; h2b[#h2b + 1] = s
        b2h[#b2h + 1] = s; b2h[#b2h + 1] = x[1]
      end
    end
    write_hashes(h2b, b2h)
  end
  write_records(put_meta, put_tab, {}, {}, lseq_add, {})
  if top > next_seq then redis.call('HSET', K_META, 'next_seq', top) end
  if #lost > 0 then
    local was = redis.call('HGET', K_RUN, 'lost') or ''
    redis.call('HSET', K_RUN, 'lost', was .. table.concat(lost, ' ') .. ' ')
  end
  held_write(held, nrefs - #w.unreserve, kept)
  stats.sequences_lost = #lost
  stats.sequences_created = kept
  return work, next + #todo
end

-- One piece of a claim longer than a part (``p.piece``: claims = [the claim, its table
-- and hashes from block ``p.from`` on, at most ``budget`` blocks]): its blocks are checked
-- and taken as a claim's, into a staged record of the claimed number (state "s"); the last
-- piece makes it the sequence. A piece that finds a block the lease cannot keep makes the
-- claim lost and gives back what the earlier pieces took (an unhashed block to the lease's
-- reserve, a hashed one to the evictable set). Returns the work done and the next claim.
local function claim_piece(next)
  local c = p.claims[1]
  local from = tonumber(redis.call('HGET', K_RUN, 'from')) or 1
  if p.offset ~= next or p.from ~= from or not c then return 1, next end
  local nf = string.format('%d', c.n)
  local rec
  if from == 1 then
    local next_seq = tonumber(redis.call('HGET', K_META, 'next_seq')) or 0
    local holder, old = redis.call('HGET', K_SEQS, nf), redis.call('HGET', K_RUN, 'n' .. nf)
    if holder or not (old or c.n > next_seq or granted_numbers(lease)(c.n)) then
      redis.call('HSET', K_RUN, 'lost', (redis.call('HGET', K_RUN, 'lost') or '') .. nf .. ' ')
      stats.sequences_lost = 1
      return 1, next + 1
    end
    rec = {f = nf, l = lease, t = c.t, c = c.c, k = c.k, h = c.h, st = 's', pages = {}, nb = 0, add = {}}
    redis.call('ZADD', K_LSEQ, 0, lease .. ':' .. nf)
    if c.n > next_seq then redis.call('HSET', K_META, 'next_seq', c.n) end
    run_set(nf, {lease = lease, left = 0, kind = 'claim'})
    held_write(held, 0, 1)
  else
    rec = load_rec(nf, redis.call('HGET', K_SEQS, nf) or '')
    if not rec or rec.st ~= 's' then return 1, next + 1 end
  end
  -- Who holds what now (as claims() reads it), for the piece's blocks.
  local tab = c.tab
  local bf = {}
  for i, b in ipairs(tab) do bf[i] = D[b] or dec(b) end
  local rs, hs, res = hmget_chunked(K_REF, bf), hmget_chunked(K_B2H, bf), hmget_chunked(K_RESERVE, bf)
  local tf = {}
  for i, f in ipairs(bf) do tf[i] = B .. f end
  local tk = hmget_chunked(K_RUN, tf)
  local good = true
  for i, b in ipairs(tab) do
    local j = from + i - 1
    if hs[i] then
      good = j <= c.c and hs[i] == c.hs[i]           -- shared read-only, or evictable
    else
      good = res[i] == lease or tk[i] ~= false       -- the lease's alone
    end
    if not good then break end
  end
  if not good then
    -- Lost: what the earlier pieces took goes back.
    if rec.nb > 0 then
      local blocks = rec_blocks(rec)
      load_refs(blocks)
      for k = #blocks, 1, -1 do decref(blocks[k]) end
      local w = changes()
      local zb, zf = zeroed()
      local zh = #zf > 0 and hmget_chunked(K_B2H, zf) or {}
      for b, r in pairs(refs) do
        if r > 0 and r ~= orig[b] then
          w.set_ref[#w.set_ref + 1] = D[b] or dec(b); w.set_ref[#w.set_ref + 1] = D[r] or dec(r)
        end
      end
      for i, b in ipairs(zb) do
        w.del_ref[#w.del_ref + 1] = zf[i]
        if zh[i] then
          park(w, zf[i], true)
        else
          w.reserve_add[#w.reserve_add + 1] = zf[i]; w.reserve_add[#w.reserve_add + 1] = lease
          reserved = reserved + 1
        end
      end
      write_changes(w)
      held_write(held, #w.reserve_add / 2 - rec.nb, 0)
    end
    local del, del_tab = {}, {}
    drop_record(rec, del, del_tab)
    write_records({}, {}, del, del_tab, {}, {lease .. ':' .. nf})
    run_end(nf)
    held_write(held, 0, -1)
    redis.call('HSET', K_RUN, 'lost', (redis.call('HGET', K_RUN, 'lost') or '') .. nf .. ' ')
    redis.call('HDEL', K_RUN, 'from')
    stats.sequences_lost = 1
    return 1 + #tab, next + 1
  end
  local w = changes()
  local took, reg = {}, {}
  for i, b in ipairs(tab) do
    local f = bf[i]
    local r = tonumber(rs[i]) or 0
    if r == 0 then
      if hs[i] then
        w.revive[#w.revive + 1] = f
      elseif res[i] == lease then
        w.unreserve[#w.unreserve + 1] = f
        took[#took + 1] = B .. f; took[#took + 1] = 1
      end
    end
    w.set_ref[#w.set_ref + 1] = f; w.set_ref[#w.set_ref + 1] = D[r + 1] or dec(r + 1)
    if from + i - 1 <= c.c and not hs[i] then reg[#reg + 1] = {c.hs[i], f} end
  end
  write_changes(w)
  reserved = reserved - #w.unreserve
  if #took > 0 then call_chunked('HSET', K_RUN, took, 2) end
  if #reg > 0 then      -- (the commits the pool lost: registered again where the hash is free)
    local want = {}
    for k, x in ipairs(reg) do want[k] = x[1] end
    local got = hmget_chunked(K_H2B, want)
    local h2b, b2h = {}, {}
    for k, x in ipairs(reg) do
      if not got[k] then
        h2b[#h2b + 1] = x[1]; h2b[#h2b + 1] = x[2]
        b2h[#b2h + 1] = x[2]; b2h[#b2h + 1] = x[1]
      end
    end
    write_hashes(h2b, b2h)
  end
  rec.add = tab
  local put_tab = {}
  rec_page_writes(rec, nil, put_tab)
  rec.nb, rec.add = rec.nb + #tab, {}
  held_write(held, #tab - #w.unreserve, 0)
  if from + #tab - 1 >= p.blocks then
    rec.st = ''
    stats.sequences_created = 1
    write_records({nf, meta_string(rec)}, put_tab, {}, {}, {}, {})
    run_end(nf)
    redis.call('HDEL', K_RUN, 'from')
    return 1 + #tab, next + 1
  end
  write_records({nf, meta_string(rec)}, put_tab, {}, {}, {}, {})
  redis.call('HSET', K_RUN, 'from', from + #tab)
  return 1 + #tab, next
end

-- ------------------------------------------------------------------ the part

local stage = redis.call('HGET', K_RUN, 'stage')
local next = tonumber(redis.call('HGET', K_RUN, 'next'))
-- (a part does about ``budget`` blocks of work, 1.5 times it at most: the drop, then, if
-- it took half the budget at most, the claims in what is left, so that a small resync
-- keeps the lease's cached blocks out of the evictable set between two calls, where
-- another lease's call could evict them)
local left = budget
if stage == 'drop' then
  local work, done = drop()
  left = (done and work <= budget / 2) and budget - work or 0
  if done then stage = 'claims' end
end
if stage == 'claims' and left > 0 then
  if next < p.total then
    local _
    if p.piece then _, next = claim_piece(next) else _, next = claims(next, left) end
    left = 0
  end
  if next >= p.total then stage = 'reclaim' end
end
if stage == 'reclaim' and left > 0 then
  set_lease_progress(lease, applied, reserved)
  local got, done = reclaim_reserve(lease, math.max(256, left))
  reserved = reserved - got
  held_write(held, -got, 0)
  if done then stage = 'finish' end
end
changed()
if stage ~= 'finish' then
  set_lease_progress(lease, applied, reserved)
  redis.call('HSET', K_RUN, 'stage', stage, 'next', next)
  incr_stats(stats)
  return reply({epoch = epoch, generation = gen, done = false, next = next,
                from = tonumber(redis.call('HGET', K_RUN, 'from')) or 1})
end
set_lease_progress(lease, p.first_entry - 1, 0)
local lost = {}
for n in string.gmatch(redis.call('HGET', K_RUN, 'lost') or '', '%d+') do lost[#lost + 1] = tonumber(n) end
redis.call('HDEL', K_STATE, MARK, 'numbers:' .. lease)   -- (the client drops its unused numbers)
redis.call('DEL', K_RUN)
stats.journal_resyncs = 1
incr_stats(stats)
return remember(K_REQUEST, p, reply({epoch = epoch, generation = gen, done = true, applied = p.first_entry - 1,
                                    lost = lost, reserve = {}, cap = p.cap}))
