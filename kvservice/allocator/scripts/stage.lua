--- stage: one bounded part of a run, an operation larger than one script call (DESIGN
--- §14; lib/runs): a create or a fork is built as a staged record, part after part, then
--- made a sequence; a long sequence is freed from its last block, part after part.
---
---   create  the first call (no run under the request key yet) admits the blocks the
---           create takes beyond the cached blocks others hold already (``expect``: the
---           allocator's probe), or answers RESOURCE_EXHAUSTED {needed, available} and
---           writes nothing; then it starts the staged record (a sequence number, the
---           lease's, state "s"). Each part then takes the next blocks: the longest cached
---           prefix first (pinned: ref + 1, revived if evictable; never the last prompt
---           token), then new blocks (free list, never used, LRU eviction). A part that
---           needs more than its admission is admitted more if the pool has it, else it
---           answers the internal RUN_SHORT {needed, available} and writes nothing (the
---           caller frees the staged record: every block goes back). Once every block is
---           held, parts register the hashes of the new full blocks (those already cached
---           under another block stay unhashed); then the record becomes a sequence
---           (``hold``: not before a ``flip`` call);
---   grow    as a create of ``num_tokens`` with no prompt: new blocks only, staged for a
---           step that grows a sequence by more than one call takes (scripts/step.lua
---           grafts them onto it; they never become a sequence of their own);
---   fork    the first call starts a staged child of ``parent`` (live, the lease's); each
---           part copies the next blocks of the parent's table as it was at the first call
---           (ref + 1 each); then the child becomes a sequence (``hold``: at a ``flip``);
---   flip    a held staged record becomes a sequence;
---   free    frees ``sequence`` (live or staged; a staged create's new blocks lose their
---           hashes) from its last block, ``budget`` blocks a call, until it is gone.
--- Every part but a create's or a grow's first needs the run's sequence number (``sequence``).
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31]: the request key
--- (a create's or a fork's: it names the run while it goes on, so that a retry resumes
--- it, and keeps the outcome).
--- ARGV[1]: msgpack map {op, pool, epoch, generation (the pool's as the caller heard it;
---   0: none; not checked for a free), lease_id, lease_left_ms (0: attached already),
---   tenant, quota = {blocks, sequences}, request_id, fingerprint, request_ttl_ms, budget
---   (blocks of work per part), sequence (the run's record; 0 on a create's first call),
---   hold; create, grow: num_tokens, root_hash (hex), expect (blocks to admit), first (the
---   index, from 1, of the block whose hash is hashes[1]), hashes = [hash hex of the
---   part's full blocks], defer (the new blocks get no hash: the client commits them once
---   written); fork: parent}
--- Returns msgpack {epoch, sequence, num_blocks (held so far), num_committed_blocks,
---   num_cached_tokens, blocks (the blocks this part added), done (a sequence now, or
---   gone for a free), ready (held and complete), last_hash, num_tokens}; or an error
---   (lib/codec): NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION (reasons
---   EPOCH_CHANGED, LEASE_EXPIRED, ROLLED_BACK {generation}), RESOURCE_EXHAUSTED {needed, available} (reason
---   QUOTA_EXCEEDED past a quota), and the internal RUN_SHORT {needed, available},
---   STALE_EPOCH {epoch}, LEASE_UNKNOWN.
--- @include "lib/time"
--- @include "lib/request"
--- @include "lib/runs"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
local lease = p.lease_id

local function field(n)
  return string.format('%d', n)
end

-- The run's record, the lease's, in one of ``states``.
local function own_record(n, states, what)
  local meta = redis.call('HGET', K_SEQS, n)
  local rec = meta and load_rec(n, meta)
  if not rec or not states[rec.st] then bad('NOT_FOUND', what .. ' ' .. p.pool .. '/' .. n .. ' not found') end
  if rec.l ~= lease then bad('PERMISSION_DENIED', what .. ' ' .. p.pool .. '/' .. n .. ' belongs to another lease') end
  return rec
end

local function reply_of(rec, epoch, extra)
  local out = {epoch = epoch, sequence = tonumber(rec.f), num_blocks = rec_len(rec), num_committed_blocks = rec.c,
               num_cached_tokens = rec.k, num_tokens = rec.t, last_hash = rec.h, blocks = {}, done = false,
               ready = false}
  for k, v in pairs(extra or {}) do out[k] = v end
  return out
end

-- A staged record becomes a sequence: its run ends, the counters count it.
local function flip(rec, run, stats)
  run_end(rec.f, run)
  rec.st = ''
  redis.call('HSET', K_SEQS, rec.f, meta_string(rec))
  stats.sequences_created = 1
  if run.kind == 'create' then
    stats.prefix_queried_tokens = rec.t
    stats.prefix_hit_tokens = rec.k
  end
end

local stats = {}
local ok, res = guarded(function()
  local epoch, num_blocks, bs, gen = pool_meta(p.pool)
  if p.epoch ~= epoch then bad('STALE_EPOCH', 'pool ' .. p.pool .. ' is at epoch ' .. epoch, {epoch = epoch}) end
  local now = now_ms()
  local op = p.op
  if op ~= 'free' then check_generation(p, gen) end    -- (a run's own blocks go back whatever the generation)
  local n = p.sequence > 0 and field(p.sequence) or nil
  local attach = lease_in_pool(p.pool, lease, p.lease_left_ms, now, op == 'create' or op == 'fork' or op == 'grow')

  if op == 'free' then
    local rec = own_record(n, {[''] = true, s = true, f = true, d = true}, 'sequence')
    if rec.st == 's' and redis.call('GET', K_REQUEST) == p.fingerprint .. '#' .. n then
      redis.call('DEL', K_REQUEST)     -- (a discarded run: its request may be tried afresh)
    end
    begin_free(rec, stats)
    local _, gone = release_tail(rec, p.budget, num_blocks, bs, false)
    return reply_of(rec, epoch, {done = gone})
  end

  if op == 'flip' then
    local rec = own_record(n, {s = true, [''] = true}, 'staged sequence')
    if rec.st == '' then return reply_of(rec, epoch, {done = true}) end     -- (flipped before: a retry)
    local run = run_get(n)
    if not run or rec_len(rec) < (run.kind == 'fork' and run.pnb or math.ceil(rec.t / bs)) then
      bad('FAILED_PRECONDITION', 'staged sequence ' .. p.pool .. '/' .. n .. ' is not complete')
    end
    flip(rec, run, stats)
    local out = reply_of(rec, epoch, {done = true})
    if p.request_id ~= '' then redis.call('SET', K_REQUEST, p.fingerprint .. reply(out), 'PX', p.request_ttl_ms) end
    return out
  end

  -- create / grow / fork: the run under the request key, or a new one.
  local prev = redis.call('GET', K_REQUEST)
  if prev then
    if string.sub(prev, 1, FINGERPRINT_LEN) ~= p.fingerprint then
      bad('INVALID_ARGUMENT', 'request_id ' .. p.request_id .. ' was already used with different arguments')
    end
    local mark = string.match(string.sub(prev, FINGERPRINT_LEN + 1), '^#(%d+)$')
    if not mark then return {replay = string.sub(prev, FINGERPRINT_LEN + 1)} end
    n = mark
  end
  local held = held_load(lease, p.tenant)
  local rec, run
  if not n then
    if op == 'create' or op == 'grow' then
      local total = math.ceil(p.num_tokens / bs)
      held_check(held, total, 1, p.quota, p.pool)
      local available = available_now(num_blocks)
      if p.expect > available then
        bad('RESOURCE_EXHAUSTED', 'pool ' .. p.pool .. ': needed ' .. p.expect .. ' blocks, ' .. available ..
          ' available', {needed = p.expect, available = available})
      end
      n = field(redis.call('HINCRBY', K_META, 'next_seq', 1))
      rec = {f = n, l = lease, t = p.num_tokens, c = 0, k = 0, h = op == 'grow' and '0' or p.root_hash, st = 's',
             pages = {}, nb = 0, add = {}}
      run = {lease = lease, left = p.expect, kind = op}
      admit(p.expect)
    else
      local parent = own_record(field(p.parent), {[''] = true}, 'sequence')
      held_check(held, parent.nb, 1, p.quota, p.pool)
      n = field(redis.call('HINCRBY', K_META, 'next_seq', 1))
      rec = {f = n, l = lease, t = parent.t, c = parent.c, k = parent.k, h = parent.h, st = 's', pages = {}, nb = 0,
             add = {}}
      run = {lease = lease, left = 0, kind = 'fork', parent = parent.f, pnb = parent.nb}
    end
    run_set(n, run)
    redis.call('HSET', K_SEQS, n, meta_string(rec))
    redis.call('ZADD', K_LSEQ, 0, lease .. ':' .. n)
    redis.call('SET', K_REQUEST, p.fingerprint .. '#' .. n, 'PX', p.request_ttl_ms)
    held_write(held, 0, 1)
    if attach then extend_lease(lease, p.lease_left_ms, now) end
  else
    rec = own_record(n, {s = true}, 'staged sequence')
    run = run_get(n)
    if not run then bad('FAILED_PRECONDITION', 'staged sequence ' .. p.pool .. '/' .. n .. ' has no run') end
  end
  return {epoch = epoch, num_blocks = num_blocks, bs = bs, rec = rec, run = run, held = held}
end)
if not ok then return res end
if res.replay then return res.replay end
if res.done ~= nil then
  changed()
  incr_stats(stats)
  return reply(res)
end

local epoch, num_blocks, bs, rec, run, held = res.epoch, res.num_blocks, res.bs, res.rec, res.run, res.held

-- Stores the record's meta and its changed pages, and the run.
local function store(map)
  local put_tab = {}
  rec_page_writes(rec, map, put_tab)
  write_records({rec.f, meta_string(rec)}, put_tab, {}, {}, {}, {})
end

local function finish()
  changed()
  incr_stats(stats)
end

-- ------------------------------------------------------------------ fork: copy a part
if run.kind == 'fork' then
  local ok2, err = guarded(function()
    if rec.nb < run.pnb then
      local meta = redis.call('HGET', K_SEQS, run.parent)
      local parent = meta and load_rec(run.parent, meta)
      if not parent or parent.st ~= '' or parent.nb < run.pnb then
        bad('FAILED_PRECONDITION', 'sequence ' .. p.pool .. '/' .. run.parent .. ' was freed or changed while ' ..
          'it was being forked')
      end
      local blocks = plan_copy(rec, parent, run.pnb, p.budget)
      held_check(held, #blocks, 0, p.quota, p.pool)
      return blocks
    end
    return {}
  end)
  if not ok2 then return err end
  local blocks = err
  if #blocks > 0 then
    write_copy(rec, blocks, num_blocks, stats, held)
    run_set(rec.f, run)
  end
  local out = reply_of(rec, epoch, {blocks = blocks})
  if rec.nb >= run.pnb then
    if p.hold then
      out.ready = true
    else
      flip(rec, run, stats)
      out.done = true
      finish()
      return remember(K_REQUEST, p, reply(out))
    end
  end
  finish()
  return reply(out)
end

-- ------------------------------------------------------------------ create (or grow)
local total = math.ceil(rec.t / bs)
local full = math.floor(rec.t / bs)
local max_hit = math.floor((rec.t - 1) / bs)
if run.kind == 'grow' then full, max_hit = 0, 0 end      -- (new blocks only, and no hashes)

local function hash_at(i)
  return p.hashes[i - p.first + 1]
end

if rec.nb < total then
  -- A part of blocks: cached ones while the prefix lasts, then new ones.
  local from, upto = rec.nb + 1, math.min(total, rec.nb + p.budget)
  if p.first ~= from or #p.hashes < math.min(upto, full) - from + 1 then
    return reply(reply_of(rec, epoch))       -- (the caller sends the hashes from here)
  end
  local hits = {}
  if rec.k == rec.nb * bs then           -- (every block so far a hit: the prefix goes on)
    local want = {}
    for i = from, math.min(upto, max_hit) do want[#want + 1] = hash_at(i) end
    if #want > 0 then
      local got = hmget_chunked(K_H2B, want)
      for i = 1, #got do
        if not got[i] then break end
        hits[i] = tonumber(got[i])
      end
    end
  end
  local ok2, err = guarded(function()
    load_refs(hits)
    local cost = 0
    for _, b in ipairs(hits) do
      if refs[b] == 0 then cost = cost + 1 end
      refs[b] = refs[b] + 1
    end
    local add = {}
    for i, b in ipairs(hits) do add[i] = b end
    for _ = from + #hits, upto do
      add[#add + 1] = placeholder()
      cost = cost + 1
    end
    held_check(held, #add, 0, p.quota, p.pool)
    if cost > run.left then
      local extra = cost - run.left
      local available = available_now(num_blocks)
      if extra > available then
        bad('RUN_SHORT', 'pool ' .. p.pool .. ': needed ' .. extra .. ' more blocks, ' .. available .. ' available',
          {needed = extra, available = available})
      end
      admit(extra)
      run.left = run.left + extra
    end
    run.left = run.left - cost
    admit(-cost)
    return add
  end)
  if not ok2 then return err end
  local add = err
  local map = apply(num_blocks, {}, stats, nil)
  rec.add = add
  if #hits > 0 then
    rec.k = rec.k + #hits * bs
    rec.c = rec.c + #hits
    rec.h = hash_at(from + #hits - 1)
  end
  store(map)
  local blocks = rec_added(rec, map)
  rec.nb, rec.add = rec.nb + #add, {}
  run_set(rec.f, run)
  held_write(held, #add, 0)
  finish()
  return reply(reply_of(rec, epoch, {blocks = blocks}))
end

if rec.c < full and not p.defer then
  -- A part of hash registrations: the new full blocks join the prefix cache (deferred:
  -- the client commits them once their KV is written).
  local from, upto = rec.c + 1, math.min(full, rec.c + p.budget)
  if p.first ~= from or #p.hashes < upto - from + 1 then return reply(reply_of(rec, epoch)) end
  local hs, fields = {}, {}
  for i = from, upto do hs[#hs + 1] = hash_at(i) end
  local blocks = rec_blocks(rec, from, upto)
  for i, b in ipairs(blocks) do fields[i] = D[b] or dec(b) end
  local cached, cur = hmget_chunked(K_H2B, hs), hmget_chunked(K_B2H, fields)
  local h2b, b2h, seen = {}, {}, {}
  for i, h in ipairs(hs) do
    if not cached[i] and not cur[i] and not seen[h] then
      seen[h] = true
      h2b[#h2b + 1] = h; h2b[#h2b + 1] = fields[i]
      b2h[#b2h + 1] = fields[i]; b2h[#b2h + 1] = h
    end
  end
  write_hashes(h2b, b2h)
  rec.c, rec.h = upto, hs[#hs]
  store({})
  finish()
  return reply(reply_of(rec, epoch))
end

local out = reply_of(rec, epoch)
if p.hold or run.kind == 'grow' then
  out.ready = true
  return reply(out)
end
flip(rec, run, stats)
out.done = true
finish()
return remember(K_REQUEST, p, reply(out))
