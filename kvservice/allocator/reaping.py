"""When the reaper sweeps each pool (docs/allocator.md, "Leases and the reaper").

A sweep of every pool at every tick costs a replica one script call per pool per tick,
with or without leases: 2,000 idle pools at 0.5 s cost half a core. So each replica keeps,
per pool, the moment its next lease deadline passes, as far as the replica knows, and a
tick sweeps only the pools that are due:

- a sweep's reply says when the pool's earliest lease deadline passes (``next_ms``: time
  left on the pool's own clock, so shard clocks need not agree); the pool is due again
  then, or after ``recheck`` seconds at the latest;
- a lease this replica attaches to a pool, or keeps alive there, makes the pool due by that
  lease's deadline at the latest (``expect``): the replica that serves a lease knows when
  it can expire;
- a pool the replica has not swept yet (a new one, or every pool when the replica starts)
  is due at a random moment within ``recheck``, so that the first sweeps spread out.

``recheck`` bounds the case no replica foresaw: a lease whose replica died before the
lease did is reaped within ``recheck`` of its deadline by another one. A revoked lease is
reaped at once by the replica that revokes it, whatever the schedule.
"""

from __future__ import annotations

import math
import random
import time
from typing import Iterable


class ReapSchedule:
    """Per pool, the monotonic time from which a sweep is due."""

    def __init__(self, recheck: float, clock=time.monotonic) -> None:
        self.recheck = recheck
        self._clock = clock
        self._due: dict[str, float] = {}
        self._rng = random.Random()

    def due(self, pools: Iterable[str]) -> list[str]:
        """The pools among ``pools`` whose sweep is due now."""
        now = self._clock()
        out = []
        for pool_id in pools:
            at = self._due.get(pool_id)
            if at is None:
                at = self._due[pool_id] = now + self._rng.random() * self.recheck
            if at <= now:
                out.append(pool_id)
        return out

    def swept(self, pool_id: str, started: float, next_ms: int) -> None:
        """A sweep of the pool that began at ``started`` (this clock) left its earliest lease
        deadline ``next_ms`` ahead (-1: no lease there). A lease expected during the sweep
        (``expect``) keeps its earlier moment."""
        later = started + min(self.recheck, next_ms / 1000 if next_ms >= 0 else math.inf)
        current = self._due.get(pool_id, math.inf)
        self._due[pool_id] = min(later, current) if current > started else later

    def expect(self, pools: Iterable[str], left_ms: int) -> None:
        """A lease in ``pools`` ends ``left_ms`` from now unless kept alive: each is due by
        then at the latest."""
        at = self._clock() + left_ms / 1000
        for pool_id in pools:
            self._due[pool_id] = min(self._due.get(pool_id, math.inf), at)

    def retry(self, pool_id: str) -> None:
        """A sweep that could not be done (the pool's Redis unreachable): due again now."""
        self._due[pool_id] = self._clock()

    def forget(self, pool_id: str) -> None:
        self._due.pop(pool_id, None)
