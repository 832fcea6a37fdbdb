--- exporter_release: drops the metrics exporter lease if this replica holds it.
---
--- KEYS[1]: the exporter key.
--- ARGV[1]: msgpack map {replica}
--- Returns msgpack {released (whether this replica held it)}.
--- @include "lib/codec"

local K_EXPORTER = KEYS[1]
local p = args()
if redis.call('GET', K_EXPORTER) == p.replica then
  redis.call('DEL', K_EXPORTER)
  return reply({released = true})
end
return reply({released = false})
