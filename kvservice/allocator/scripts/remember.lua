--- remember: keeps the outcome of a step that the allocator carried out in parts
--- (kvservice/allocator/runs.py) under the step's request id, as the step script keeps
--- its own (lib/request): a retry of the step returns it.
---
--- KEYS[1]: the request key (kvservice/allocator/keys.py, request_key).
--- ARGV[1]: msgpack map {fingerprint (64 hex digits), outcome (what the step script's reply
---   would be, a map), request_ttl_ms}
--- Returns msgpack {kept (false when the key held another request's outcome)}.
--- @include "lib/codec"

local p = args()
local prev = redis.call('GET', KEYS[1])
if prev and string.sub(prev, 1, 64) ~= p.fingerprint then return reply({kept = false}) end
redis.call('SET', KEYS[1], p.fingerprint .. reply(p.outcome), 'PX', p.request_ttl_ms)
return reply({kept = true})
