"""The block allocator service: state in Redis, mutated only by the Lua scripts of
``scripts/``; any number of stateless replicas serve one Redis.

Layers, bottom up: ``keys`` (key names), ``codec`` (msgpack arguments and replies of the
scripts), ``store`` (runs the scripts, reads state), ``domain`` (small request and result
objects), ``core`` (the ``Allocator``: checks requests, hashes blocks with
``kvservice.common.hashing``, plans the per-pool script calls), ``servicer`` (proto <->
domain), ``server`` (the gRPC server, the reaper), ``audit`` (the invariants),
``metrics``, ``config`` (``Settings``), ``embedded`` (a private Redis server for local runs).
"""
