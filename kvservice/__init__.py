"""kvservice: a distributed manager of the paged KV cache of LLM inference.

What an engine imports is here: ``Client`` and ``Sequence`` (the SDK, ``kvservice.client``)
and ``errors``. The layers, one folder each:

- ``kvservice.allocator``: the block allocator service (domain, core, store, Lua scripts,
  servicer, server, audit);
- ``kvservice.common``: what the SDK, the allocator and the workers share (gRPC server
  helpers, the error interceptor, settings, the pool geometry, the metrics catalogue);
- ``kvservice.engine``: the continuous-batching engine and the demo;
- ``kvservice.tools``: the process launcher and the benchmark;
- ``kvservice.simulate``: the memory study.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvservice import errors

if TYPE_CHECKING:
    from kvservice.client import Client, Sequence

__all__ = ["Client", "Sequence", "errors"]


def __getattr__(name: str) -> Any:
    # The SDK loads on first use, so that ``import kvservice.<layer>`` stays light.
    if name in ("Client", "Sequence"):
        from kvservice import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvservice' has no attribute {name!r}")
