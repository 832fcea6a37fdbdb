--- A pool's generation (docs/allocator.md, "Generations"): new at each registration and
--- whenever the Redis process that serves the pool is not the one recorded with it. A
--- restarted Redis may have reloaded an AOF or a snapshot that misses its last
--- acknowledged writes, a promoted replica may have lagged: the pool's state may have
--- rolled back, and the first script that runs there after it begins a new generation,
--- before any block is handed out again. Callers that send another generation than the
--- pool's are refused (reason ROLLED_BACK) until they resynchronise.
--- The pool's meta hash keeps ``generation`` (the Redis clock in microseconds when it
--- began: no two processes begin one for a pool in the same microsecond), ``server`` (the
--- run_id of the process that began it) and ``generations`` (how many began in the
--- pool's life).
--- NOTE: a run_id, not a marker key: a key, even one written unreplicated, can come back
--- from an RDB snapshot or an AOF rewrite; a run_id is the process's own.

-- The run_id of the Redis process running this script (new with every start; a promoted
-- replica has its own).
local function server_run_id()
  return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
end

-- Begins a generation of the pool whose meta hash is ``meta``, served by ``run``; returns it.
local function begin_generation(meta, run)
  local t = redis.call('TIME')
  local gen = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('HSET', meta, 'generation', gen, 'server', run)
  redis.call('HINCRBY', meta, 'generations', 1)
  return gen
end

-- The pool's generation, given its meta fields ``generation`` and ``server`` as read: a
-- new one when this process is not the one that began it.
local function current_generation(meta, recorded, server)
  local run = server_run_id()
  if server == run and recorded then return tonumber(recorded) end
  return begin_generation(meta, run)
end
