--- step: one engine step in one pool: commits, frees, forks, growth (with copy-on-write)
--- and creates, all-or-nothing: the whole call is planned and checked, then written.
---
--- KEYS[1..30]: the pool's keys (kvservice/allocator/keys.py); KEYS[31]: the request key.
--- ARGV[1]: msgpack map
---   pool, generation (the pool's as the caller heard it, lib/generation; 0: none), request_id
---   ('': none), fingerprint (64 hex digits), request_ttl_ms, lease_id,
---   lease_left_ms (the lease's time left, ms; 0: it is attached to this pool already), tenant (the
---   lease's; '' when not looked up: the pool's record of the lease names it, lib/held),
---   quota = {blocks, sequences} (the tenant's quotas in the pool; 0: none), max_blocks,
---   max_fork_refs (the block references the step's forks may add at most), max_release
---   (the blocks its frees may release at most),
---   updates = [{sequence (n of <pool>/<epoch>/<n>-<tag>), tag (as the caller gave it, for
---     messages: '' or the tag that the allocator checked), epoch, num_tokens (-1: the
---     allocator's), grow_to (0: no growth), free, num_committed_blocks (the index of the
---     first commit), parent_hash (hex; '' without commits), fork_grow_to = [length of
---     each child after the step], commits = [hash hex of each committed block], staged
---     (the allocator's own: a staged child of a fork in parts, grown before it is made a
---     sequence; lib/runs), graft (0, or a grow run's staged record whose blocks are the
---     growth's new blocks, scripts/stage.lua: appended, not allocated), graft_cow (its
---     first block is the copy-on-write destination, released if no copy is needed)}],
---   creates = [{epoch, num_tokens, root_hash (hex), block_hashes = [hex per full block],
---     tier_loads (the caller runs the answer's loads: the lookup goes on into the lower tiers),
---     fetch (optional: {from, n}: another pool holds the chain's blocks from .. from + n - 1
---     pinned for a fetch, DESIGN §13; the lookup goes on through those), migrate (optional:
---     a live sequence moved here, all of whose blocks another pool holds pinned: the
---     lookup covers every block, hashed or not, the last token's too), defer (the blocks
---     past the chain cached on the device, loads and fetches included, get no hash: the
---     client commits them once written)}]
--- Returns msgpack {epoch, generation, updates = [{num_tokens, num_committed_blocks, last_hash,
---   new_blocks, cow = [src, dst] (when the last block was replaced), freed,
---   children = [record]}], created = [record], copies = [[src, dst]], tier_orders =
---   [[src_tier, src, dst_tier, dst, hash hex]] (lib/tiers: the evictions' copies down a
---   tier, then the creates' loads from one, in the order the worker runs them), fetches =
---   [[create index, position in its chain, device block]] (the blocks the caller fills
---   from the other pool's pinned ones), serial (the pool's change counter after the step:
---   the serial of the step's grants)}, where record =
---   {sequence, num_tokens, num_committed_blocks, num_cached_tokens, last_hash,
---   block_table, cow = [src, dst] (a child's), shared (a child's: how many blocks of its
---   table are its parent's)}; or an error (lib/codec): NOT_FOUND,
---   INVALID_ARGUMENT, FAILED_PRECONDITION (reasons EPOCH_CHANGED, LEASE_EXPIRED,
---   RESYNC_IN_PROGRESS, ROLLED_BACK {generation}), PERMISSION_DENIED, RESOURCE_EXHAUSTED
---   {needed, available} (and {reason QUOTA_EXCEEDED, quota, limit} past a quota), and the
---   internal STALE_EPOCH {epoch}, LEASE_UNKNOWN and TOO_BIG {frees = [[update index,
---   blocks]], forks = [[update index, parent's blocks]], grows = [[update index, new
---   blocks, 1 if its last block is partial (a copy may be needed) else 0]]} (more than
---   one call's work: nothing is read beyond the records).
--- @include "lib/time"
--- @include "lib/request"
--- @include "lib/runs"

local K_REQUEST = KEYS[NUM_POOL_KEYS + 1]
local p = args()
TIER.orders = {}
local ok0, gen = guarded(function() return checked_generation(p) end)
if not ok0 then return gen end
local prev = replay(K_REQUEST, p)
if prev then return prev end
local ups, creates = p.updates, p.creates
local lease = p.lease_id

local function sid_of(u)
  local sid = p.pool .. '/' .. string.format('%d', u.epoch) .. '/' .. u.field
  if u.tag ~= '' then sid = sid .. '-' .. u.tag end
  return sid
end

-- Checks the epochs and the lease; returns the pool's geometry and whether the lease
-- must be attached to the pool (its first create here).
local function check_pool_and_lease()
  local epoch, num_blocks, bs = pool_meta(p.pool)
  local now = now_ms()
  for _, u in ipairs(ups) do
    u.field = string.format('%d', u.sequence)
    if u.epoch ~= epoch then
      bad('FAILED_PRECONDITION', 'sequence ' .. sid_of(u) .. ' belongs to epoch ' .. string.format('%d', u.epoch) ..
        ' but pool ' .. p.pool .. ' was re-registered (epoch ' .. epoch .. ')', {reason = 'EPOCH_CHANGED'})
    end
  end
  for _, c in ipairs(creates) do
    if c.epoch ~= epoch then bad('STALE_EPOCH', 'pool ' .. p.pool .. ' is at epoch ' .. epoch, {epoch = epoch}) end
  end
  -- The lease must be live here, or (for creates) live in its own record.
  local attach = lease_in_pool(p.pool, lease, p.lease_left_ms, now, #creates > 0)
  return epoch, num_blocks, bs, attach
end

-- Refuses (internal TOO_BIG) a step whose work exceeds one call's bounds, before any table
-- is read: the blocks its frees release, the references its forks add, the new blocks
-- its growth, its children's and its creates take (each growth counted with a copy).
-- The allocator then carries the step out in parts (kvservice/allocator/runs.py): its
-- reply lists each free {index, blocks}, fork {index, parent's blocks} and growth
-- {index, new blocks}.
local function check_size(recs, bs)
  local frees, forks, grows = {}, {}, {}
  local released, fork_refs, new = 0, 0, 0
  for i, u in ipairs(ups) do
    local rec = recs[i]
    local t = math.max(u.num_tokens, rec.t)
    if u.free then
      released = released + rec.nb
      frees[#frees + 1] = {i, rec.nb}
    end
    if #u.fork_grow_to > 0 then
      fork_refs = fork_refs + #u.fork_grow_to * rec.nb
      forks[#forks + 1] = {i, rec.nb}
      for _, g in ipairs(u.fork_grow_to) do
        if g > t then new = new + math.max(0, math.ceil(g / bs) - rec.nb) + ((t % bs ~= 0) and 1 or 0) end
      end
    end
    if u.grow_to > t and not (u.graft and u.graft > 0) then   -- (a grafted growth's blocks are staged)
      local more, partial = math.max(0, math.ceil(u.grow_to / bs) - rec.nb), (t % bs ~= 0) and 1 or 0
      new = new + more + partial
      grows[#grows + 1] = {i, more, partial}
    end
  end
  for _, c in ipairs(creates) do new = new + math.ceil(c.num_tokens / bs) end
  if released > p.max_release or fork_refs > p.max_fork_refs or new > p.max_blocks then
    bad('TOO_BIG', 'the step takes more than one call: ' .. released .. ' blocks released, ' .. fork_refs ..
      ' references forked, ' .. new .. ' new blocks', {frees = frees, forks = forks, grows = grows})
  end
end

-- Loads every named sequence (owned by the lease) and the reference counts the plan
-- reads: every block of freed and forked sequences, the last block of the others.
local function load_sequences(bs)
  local recs = {}
  if #ups == 0 then return recs end
  local fields = {}
  for i, u in ipairs(ups) do fields[i] = u.field end
  local metas = hmget_chunked(K_SEQS, fields)
  for i, u in ipairs(ups) do
    local rec = metas[i] and load_rec(u.field, metas[i])
    -- (a staged child is named only by the allocator, which grows it within a step in parts)
    if not rec or rec.st ~= (u.staged and 's' or '') then bad('NOT_FOUND', 'sequence ' .. sid_of(u) .. ' not found') end
    if rec.l ~= lease then bad('PERMISSION_DENIED', 'sequence ' .. sid_of(u) .. ' belongs to another lease') end
    if u.num_tokens < 0 then u.num_tokens = rec.t end
    if u.num_tokens < rec.t then
      bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': num_tokens ' .. u.num_tokens ..
        ' is below the allocator\'s ' .. rec.t)
    end
    if u.num_tokens > rec.nb * bs then
      bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': num_tokens ' .. u.num_tokens ..
        ' exceeds its block table (' .. rec.nb .. ' blocks of ' .. bs .. ')')
    end
    recs[i] = rec
  end
  check_size(recs, bs)
  load_last_pages(recs)
  local want = {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    if u.free or #u.fork_grow_to > 0 then
      load_all_pages(rec)
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
  return recs
end

-- Phase 1: lengths and commits. Returns the committed hashes and their blocks.
local function sync_and_commit(recs, bs)
  local hashes, blocks = {}, {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    if u.num_tokens > rec.t and rec.t % bs ~= 0 and refs[rec.lastb or rec_block(rec, rec.nb)] > 1 then
      bad('FAILED_PRECONDITION', 'sequence ' .. sid_of(u) ..
        ': tokens were appended into its shared last block without a step')
    end
    rec.t = u.num_tokens
    local ncm = #u.commits
    if ncm > 0 then
      local first = u.num_committed_blocks
      if first ~= rec.c then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': commit starts at block ' .. first ..
          ' but ' .. rec.c .. ' blocks are committed')
      end
      if u.parent_hash ~= rec.h then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': parent_hash does not match its last committed block')
      end
      local last = first + ncm
      if last * bs > u.num_tokens then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': block ' .. (last - 1) ..
          ' is not full at num_tokens ' .. u.num_tokens)
      end
      for j = 1, ncm do
        hashes[#hashes + 1] = u.commits[j]
        local idx = first + j
        if idx == rec.nb and rec.lastb then
          blocks[#blocks + 1] = rec.lastb
        else
          blocks[#blocks + 1] = rec_block(rec, idx)
        end
      end
      rec.c = last
      rec.h = u.commits[ncm]
    end
  end
  return hashes, blocks
end

-- Which hashes are cached already (commits and prompts): hash -> block, or false.
local function lookup_hashes(commit_hashes)
  local lookup = commit_hashes
  if #creates > 0 then
    lookup = {}
    for _, h in ipairs(commit_hashes) do lookup[#lookup + 1] = h end
    for _, c in ipairs(creates) do
      for _, h in ipairs(c.block_hashes) do lookup[#lookup + 1] = h end
    end
  end
  local known = {}
  if #lookup > 0 then
    local got = hmget_chunked(K_H2B, lookup)
    for i, h in ipairs(lookup) do
      if got[i] then known[h] = tonumber(got[i]) else known[h] = false end
    end
  end
  return known
end

-- The hash registrations the plan makes: pending[h] = the block that takes h in this call
-- (reg_hs / reg_bs in order); dups[h] = a block of this call that holds content already
-- cached under h in another block (it takes h if that block is evicted by this call).
local pending, reg_hs, reg_bs, dups = {}, {}, {}, {}
local function plan_hash(h, b, known)
  if not known[h] and not pending[h] then
    pending[h] = b
    reg_hs[#reg_hs + 1] = h; reg_bs[#reg_bs + 1] = b
  elseif known[h] and not dups[h] then
    dups[h] = b
  end
end

local function plan_commits(commit_hashes, commit_blocks, known)
  if #commit_blocks == 0 then return end
  local fields = {}
  for j, b in ipairs(commit_blocks) do fields[j] = D[b] or dec(b) end
  local cur = hmget_chunked(K_B2H, fields)
  for j, h in ipairs(commit_hashes) do
    if not cur[j] then plan_hash(h, commit_blocks[j], known) end
  end
end

-- Phase 2: frees.
local function free_sequences(recs)
  local freed = {}
  local released = 0
  for i, u in ipairs(ups) do
    if u.free then
      if #u.fork_grow_to > 0 or u.grow_to > 0 then
        bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ' cannot be freed and forked or grown in one step')
      end
      freed[i] = true
    end
  end
  for i in ipairs(ups) do
    if freed[i] then release(recs[i]) end
  end
  return freed
end

-- Checked before placeholders are made: a grow_to near 2^31 would otherwise plan
-- millions of blocks (and hold Redis for seconds) before the limit is seen.
local function need_blocks(n)
  if nplace + n > p.max_blocks then
    bad('TOO_BIG', 'the step needs at least ' .. (nplace + n) .. ' new blocks; at most ' .. p.max_blocks ..
      ' per call', {frees = {}, forks = {}, grows = {}})
  end
end

-- Grows rec to g tokens: new blocks, and copy-on-write of a shared partial last block.
-- Returns the copy pair {src, dst placeholder} or nil.
local copies = {}
local grafts = {}
local function grow(rec, g, bs, graft, graft_cow)
  if g <= rec.t then return nil end
  local nb = rec_len(rec)
  local last
  if nb == rec.nb and rec.lastb and not rec.cowlast then last = rec.lastb else last = rec_block(rec, nb) end
  local shared_tail = rec.t % bs ~= 0 and refs[last] > 1
  local more = math.ceil(g / bs) - nb
  local dst = nil
  if graft and graft > 0 then
    -- The growth's blocks were staged by a grow run (scripts/stage.lua): its table is
    -- appended; with graft_cow its first block is the copy-on-write destination of a
    -- partial last block, or, when no copy is needed after all, released.
    local f = string.format('%d', graft)
    local meta = redis.call('HGET', K_SEQS, f)
    local x = meta and load_rec(f, meta)
    local run = x and run_get(f)
    local extra = graft_cow and 1 or 0
    if not x or x.st ~= 's' or x.l ~= rec.l or not run or run.kind ~= 'grow' or x.nb ~= more + extra
        or (shared_tail and not graft_cow) then
      bad('INVALID_ARGUMENT', 'staged blocks ' .. f .. ' do not fit the growth of sequence ' .. rec.f)
    end
    load_all_pages(x)
    local parts = {}
    for k = 0, (x.nb > 0 and page_of(x.nb) or -1) do parts[#parts + 1] = x.pages[k] end
    local hex = table.concat(parts)
    if graft_cow then
      local first = tonumber(string.sub(hex, 1, W), 16)
      hex = string.sub(hex, W + 1)
      load_refs({first})
      if shared_tail then dst = first else decref(first) end
      rec.graft_released = not shared_tail
    end
    rec.graft_hex, rec.graft_n, rec.graft_cow = hex, more, graft_cow
    grafts[#grafts + 1] = x
    more = 0
  end
  need_blocks(more + ((shared_tail and not dst) and 1 or 0))
  local cow = nil
  if shared_tail then
    dst = dst or placeholder()
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

-- Phase 3: forks (children share every block, then grow). The references they add are
-- bounded (p.max_fork_refs): counted before any is planned, so a refused call costs little.
local function fork_sequences(recs, bs)
  local kids = {}
  for i, u in ipairs(ups) do
    if #u.fork_grow_to > 0 then
      local rec = recs[i]
      kids[i] = {}
      for _, g in ipairs(u.fork_grow_to) do
        local child = {l = rec.l, t = rec.t, c = rec.c, h = rec.h, k = rec.k, st = '', pages = rec.pages, nb = rec.nb,
                       add = {}, lastb = rec.lastb, new = true, shared = #rec.blocks}
        for _, b in ipairs(rec.blocks) do refs[b] = refs[b] + 1 end
        if g > 0 and g < rec.t then
          bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': fork_grow_to ' .. g .. ' is below num_tokens ' .. rec.t)
        end
        child.cow = grow(child, g, bs)
        kids[i][#kids[i] + 1] = child
      end
    end
  end
  return kids
end

-- Phase 4: growth.
local function grow_sequences(recs, bs)
  local cows = {}
  for i, u in ipairs(ups) do
    local rec = recs[i]
    local g = u.grow_to
    if g > 0 and g < rec.t then
      bad('INVALID_ARGUMENT', 'sequence ' .. sid_of(u) .. ': grow_to ' .. g .. ' is below num_tokens ' .. rec.t)
    end
    if g > rec.t then cows[i] = grow(rec, g, bs, u.graft, u.graft_cow) end
  end
  return cows
end

-- Phase 5: creates (longest cached prefix, never covering the last prompt token).
local loads = {}         -- {tier code, entry, device block (a placeholder), hash}
local fetches = {}       -- {create index, position in its chain, device block (a placeholder)}
local function create_sequences(bs, known, stats)
  local made = {}
  for ci, c in ipairs(creates) do
    local hs = c.block_hashes
    local max_hit = math.floor((c.num_tokens - 1) / bs)
    -- (a migration, DESIGN §13: every block is there already, in the source pool; the
    -- blocks past the hashed ones are fetched too)
    local last = math.min(max_hit, #hs)
    if c.migrate then last = math.ceil(c.num_tokens / bs) end
    local rec = {l = lease, t = c.num_tokens, c = #hs, h = c.root_hash, k = 0, st = '', pages = {}, nb = 0, add = {},
                 new = true}
    -- The chain through the tiers: each block cached on the device is shared, one in a
    -- lower tier (ready) is loaded into a new block (lib/tiers); the first miss ends it.
    -- A block another pool holds pinned for this create (c.fetch, positions from ..
    -- from + n - 1) is fetched from there into a new block (DESIGN §13).
    local dev, lower, remote, n = {}, {}, {}, 0
    local fetch = c.fetch
    for i = 1, last do
      local b = hs[i] and (pending[hs[i]] or known[hs[i]])
      if not b then
        local t, e = nil, nil
        if c.tier_loads and hs[i] then t, e = TIER.hit(hs[i]) end
        if t then
          lower[i] = {t, e}
        elseif fetch and i >= fetch.from and i < fetch.from + fetch.n then
          remote[i] = true
        else
          break
        end
      end
      dev[i] = b
      n = i
    end
    local hits = {}
    for i = 1, n do
      if dev[i] then hits[#hits + 1] = dev[i] end
    end
    -- (deferred: only the chain cached on the device is committed; the client commits the
    -- rest, blocks loaded from a lower tier or fetched from another pool included, once
    -- their KV is written)
    if c.defer then
      local d = 0
      while d < n and d < #hs and dev[d + 1] do d = d + 1 end
      rec.c = d
    end
    if rec.c > 0 then rec.h = hs[rec.c] end
    load_refs(hits)
    local add = rec.add
    local total = math.ceil(c.num_tokens / bs)
    need_blocks(total - #hits)
    for i = 1, total do
      local b = dev[i]
      if b then
        refs[b] = refs[b] + 1
      else
        b = placeholder()
        if hs[i] and i <= rec.c then plan_hash(hs[i], b, known) end
        local l = lower[i]
        if l then
          loads[#loads + 1] = {TIER.code[l[1]], tonumber(l[2]), b, hs[i]}
          local f = 'tier_' .. l[1] .. '_'
          stats[f .. 'hit_tokens'] = (stats[f .. 'hit_tokens'] or 0) + bs
          stats[f .. 'loads'] = (stats[f .. 'loads'] or 0) + 1
        end
        if remote[i] then
          fetches[#fetches + 1] = {ci, i, b}
          stats.fetched_blocks = (stats.fetched_blocks or 0) + 1
        end
      end
      add[i] = b
    end
    rec.k = math.min(n * bs, c.num_tokens)
    if not c.migrate then
      stats.prefix_queried_tokens = stats.prefix_queried_tokens + c.num_tokens
      stats.prefix_hit_tokens = stats.prefix_hit_tokens + rec.k
    end
    made[#made + 1] = rec
  end
  return made
end

-- What the step adds to the lease's holdings (lib/held): blocks and sequences.
local function holdings_delta(recs, kids, made, freed)
  local db, ds = 0, 0
  for i in ipairs(ups) do
    local rec = recs[i]
    if freed[i] then db = db - rec_len(rec); ds = ds - 1 else db = db + #rec.add end
    for _, child in ipairs(kids[i] or {}) do db = db + rec_len(child); ds = ds + 1 end
  end
  for _, rec in ipairs(made) do db = db + rec_len(rec); ds = ds + 1 end
  -- (grafted blocks were counted with their staged record, which counted as a sequence;
  -- a graft's copy-on-write block replaces a reference, or is released)
  for i in ipairs(ups) do
    if recs[i].graft_cow then db = db - 1 end
  end
  return db, ds - #grafts
end

local stats = {prefix_queried_tokens = 0, prefix_hit_tokens = 0}
local ok, plan = guarded(function()
  local epoch, num_blocks, bs, attach = check_pool_and_lease()
  local recs = load_sequences(bs)
  local commit_hashes, commit_blocks = sync_and_commit(recs, bs)
  local known = lookup_hashes(commit_hashes)
  plan_commits(commit_hashes, commit_blocks, known)
  local freed = free_sequences(recs)
  local kids = fork_sequences(recs, bs)
  local cows = grow_sequences(recs, bs)
  local made = create_sequences(bs, known, stats)
  local held = held_load(lease, p.tenant)
  local db, ds = holdings_delta(recs, kids, made, freed)
  held_check(held, db, ds, p.quota, p.pool)
  local available = available_now(num_blocks) + net_released()
  if nplace > available then
    bad('RESOURCE_EXHAUSTED', 'pool ' .. p.pool .. ': needed ' .. nplace .. ' blocks, ' .. available .. ' available',
      {needed = nplace, available = available})
  end
  return {epoch = epoch, num_blocks = num_blocks, recs = recs, kids = kids, cows = cows, made = made,
          freed = freed, attach = attach, held = held, db = db, ds = ds}
end)
if not ok then return plan end

-- Write phase. Hashes of real blocks first, so that a block committed and freed in one
-- step is cached (it goes to the evictable set).
local function register(marked, resolve)
  local h2b, b2h = {}, {}
  for k = 1, #reg_hs do
    local b = resolve(reg_bs[k])
    if b then
      local h, s = reg_hs[k], D[b] or dec(b)
      h2b[#h2b + 1] = h; h2b[#h2b + 1] = s
      b2h[#b2h + 1] = s; b2h[#b2h + 1] = h
      if marked then marked[b] = true end
    end
  end
  write_hashes(h2b, b2h)
end

stats.cow_copies = #copies
local by_block = {}
local hashed = zero_hashed(nil)
register(by_block, function(b) if b >= 0 then return b end end)
for b in pairs(by_block) do hashed[b] = true end
local map = apply(plan.num_blocks, hashed, stats, dups)
register(nil, function(b) if b < 0 then return map[b] end end)

-- Sequence records, and the reply.
local nkids, nmade = 0, #plan.made
for _, ks in pairs(plan.kids) do nkids = nkids + #ks end
local next_n = 0
if nkids + nmade > 0 then next_n = redis.call('HINCRBY', K_META, 'next_seq', nkids + nmade) - nkids - nmade end
local put_meta, put_tab, lseq_add = {}, {}, {}

local function resolved(pair)
  if not pair then return nil end
  return {pair[1], map[pair[2]] or pair[2]}
end

-- Stores a new sequence record (a child or a create) and returns its reply record.
local function store_new(rec)
  next_n = next_n + 1
  local field = string.format('%d', next_n)
  rec.f = field
  put_meta[#put_meta + 1] = field; put_meta[#put_meta + 1] = meta_string(rec)
  rec_page_writes(rec, map, put_tab)
  lseq_add[#lseq_add + 1] = 0; lseq_add[#lseq_add + 1] = lease .. ':' .. field
  return {sequence = next_n, num_tokens = rec.t, num_committed_blocks = rec.c, num_cached_tokens = rec.k,
          last_hash = rec.h, block_table = rec_table(rec, map), cow = resolved(rec.cow), shared = rec.shared}
end

local out_updates = {}
local del, del_tab, lseq_del = {}, {}, {}
for i, u in ipairs(ups) do
  local rec = plan.recs[i]
  local children = {}
  for _, child in ipairs(plan.kids[i] or {}) do children[#children + 1] = store_new(child) end
  local out = {num_tokens = rec.t, num_committed_blocks = rec.c, last_hash = rec.h, children = children,
               freed = plan.freed[i] == true}
  if out.freed then
    drop_record(rec, del, del_tab)
    lseq_del[#lseq_del + 1] = lease .. ':' .. u.field
  else
    put_meta[#put_meta + 1] = u.field; put_meta[#put_meta + 1] = meta_string(rec)
    rec_page_writes(rec, map, put_tab)
    out.new_blocks = rec_added(rec, map)
    out.cow = resolved(plan.cows[i])
  end
  out_updates[i] = out
end
local out_made = {}
for _, rec in ipairs(plan.made) do out_made[#out_made + 1] = store_new(rec) end
local nfreed = #del
for _, x in ipairs(grafts) do
  drop_record(x, del, del_tab)
  lseq_del[#lseq_del + 1] = lease .. ':' .. x.f
  run_end(x.f)
end
write_records(put_meta, put_tab, del, del_tab, lseq_add, lseq_del)
held_write(plan.held, plan.db, plan.ds)
if plan.attach then extend_lease(lease, p.lease_left_ms, now_ms()) end
local out_copies = {}
for _, cp in ipairs(copies) do out_copies[#out_copies + 1] = resolved(cp) end
local out_orders = TIER.orders
for _, l in ipairs(loads) do
  out_orders[#out_orders + 1] = {l[1], l[2], 0, map[l[3]], l[4]}
  TIER.touch(TIER.name[l[1]], string.format('%d', l[2]))
end
local out_fetches = {}
for _, f in ipairs(fetches) do out_fetches[#out_fetches + 1] = {f[1], f[2], map[f[3]]} end
stats.sequences_created = nkids + nmade
stats.sequences_freed = nfreed
local serial = changed()
incr_stats(stats)
return remember(K_REQUEST, p, reply({epoch = plan.epoch, generation = gen, updates = out_updates,
                                    created = out_made, copies = out_copies, tier_orders = out_orders,
                                    fetches = out_fetches, serial = serial}))
