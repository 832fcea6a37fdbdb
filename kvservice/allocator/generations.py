"""Pool generations on the allocator's side (``scripts/lib/generation.lua`` is the other).

A pool's generation is new at each registration and whenever the Redis process that serves
the pool is not the one that served it last (a restart, a failover): its state may then
have rolled back, and a caller of another generation than the pool's is refused (reason
ROLLED_BACK) until it has resynchronised. The scripts compare; the allocator passes on
what the caller sent: a Step's ``generations`` (one per pool) reach every script call the
step makes, in parts too, through ``KNOWN_GENERATIONS``; a Sync's travel in its pool parts.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Mapping

#: The generation of each pool as the caller of the step being served heard it
#: (StepRequest.generations; a pool left out: 0, not checked).
KNOWN_GENERATIONS: ContextVar[Mapping[str, int]] = ContextVar("known_generations", default={})


def known_generation(pool_id: str) -> int:
    """The generation of ``pool_id`` that the step being served was sent with (0: none)."""
    return KNOWN_GENERATIONS.get().get(pool_id, 0)
