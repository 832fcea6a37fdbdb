--- exporter_claim: takes the metrics exporter lease if nobody holds it, renews it if this
--- replica does (see kvservice/allocator/metrics.py). Not allocator state.
---
--- KEYS[1]: the exporter key.
--- ARGV[1]: msgpack map {replica, ttl_ms}
--- Returns msgpack {holder (whether this replica holds the lease now)}.
--- @include "lib/codec"

local K_EXPORTER = KEYS[1]
local p = args()
local holder = redis.call('GET', K_EXPORTER)
if holder and holder ~= p.replica then
  return reply({holder = false})
end
redis.call('SET', K_EXPORTER, p.replica, 'PX', p.ttl_ms)
return reply({holder = true})
