"""The worker's fence against writes of dead leases and of a rolled-back generation
(docs/security.md, docs/allocator.md "Generations").

A lease that expired or was revoked has had its sequences freed: its blocks may already
hold another sequence's K/V. The allocator tells the worker those leases with each
heartbeat reply (``HeartbeatResponse.dead_leases``); every write (WriteKV, CopyBlocks,
Forward) names its lease and is refused, FAILED_PRECONDITION with reason LEASE_EXPIRED,
once the worker knows it dead: within one heartbeat interval (plus the allocator's reap
interval) of its death.

Every write also carries the pool's generation as its writer last heard it. When the
Redis serving the pool restarts or fails over, the pool begins a new generation (its
state may have rolled back: blocks a writer holds may be another lease's now), and a
writer of the old one is refused (reason ROLLED_BACK) until it has resynchronised with the
allocator. The worker learns the generation with each heartbeat, and at once from the
first write that carries another one than it knows (it heartbeats before it answers):
so the new owner's first write into a block fences every old writer out of the pool.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from kvservice import errors
from kvservice.common.settings import echo
from worker.rights import BlockRights

#: How long a dead lease is remembered (the allocator keeps its tombstones an hour).
REMEMBER_SECONDS = 3600.0
#: At most this many dead leases are remembered (the oldest are forgotten first).
MAX_REMEMBERED = 1 << 20
#: A write of another generation than the worker's asks the allocator at most this often
#: (seconds); in between, it is refused on what the worker knows.
MIN_REFRESH = 0.02


class LeaseFence:
    """The leases whose writes this worker refuses.

    Args:
        require_lease: refuse a write that names no lease (a worker that authenticates
            its callers); otherwise such a write passes (a development worker).
    """

    def __init__(self, require_lease: bool = False) -> None:
        self.require_lease = require_lease
        self._dead: dict[str, float] = {}
        #: The allocator's cursor: the next heartbeat's ``dead_since_ms``.
        self.dead_until_ms = 0
        #: The pool's generation as the allocator last said (None: not checked, a worker
        #: that serves no allocator).
        self.generation: int | None = None
        #: Asks the allocator now (a heartbeat that sets ``generation``): the registrar's.
        self.refresh: Callable[[], Awaitable[None]] | None = None
        self._refreshing: asyncio.Lock | None = None
        self._refreshed_at = -float("inf")
        #: Writes refused, by reason (LEASE_EXPIRED, ROLLED_BACK).
        self.refused: dict[str, int] = {"LEASE_EXPIRED": 0, "ROLLED_BACK": 0}
        #: The pool's table of grants (``worker/rights.py``; None: a worker with no pool
        #: registered with an allocator): the dead leases are forgotten there too.
        self.rights: BlockRights | None = None

    def __len__(self) -> int:
        return len(self._dead)

    def learn(self, dead_leases: list[str], dead_until_ms: int) -> None:
        """Adds the leases a heartbeat reply named, and moves the cursor."""
        now = time.monotonic()
        for lease in dead_leases:
            self._dead[lease] = now
        if self.rights is not None and dead_leases:
            self.rights.forget(dead_leases)
        self.dead_until_ms = max(self.dead_until_ms, dead_until_ms)
        if len(self._dead) > MAX_REMEMBERED or (self._dead and now - next(iter(self._dead.values())) > REMEMBER_SECONDS):
            cutoff = now - REMEMBER_SECONDS
            keep = sorted(self._dead.items(), key=lambda kv: kv[1])[-MAX_REMEMBERED:]
            self._dead = {k: t for k, t in keep if t >= cutoff}

    def check(self, lease_id: str, what: str) -> None:
        """Raises unless a write of ``lease_id`` may go ahead.

        Raises:
            FailedPrecondition (reason LEASE_EXPIRED): the lease is dead.
            InvalidArgument: no lease named, where one is required.
        """
        if not lease_id:
            if self.require_lease:
                raise errors.InvalidArgument(f"{what} must name its lease (lease_id): this worker fences writes")
            return
        if lease_id in self._dead:
            self.refused["LEASE_EXPIRED"] += 1
            raise errors.LeaseExpired(f"{what}: lease {echo(lease_id)} expired or was revoked; its blocks may "
                                      f"belong to another sequence now")

    async def check_generation(self, generation: int, what: str) -> None:
        """Raises unless a write of ``generation`` may go ahead: it must be the pool's. One
        the worker has not heard makes it ask the allocator first (``refresh``).

        Raises:
            RolledBack: another generation than the pool's.
        """
        if self.generation is None or generation == self.generation:
            return
        if self.refresh is not None:
            await self._refresh_once()
        if generation != self.generation:
            self.refused["ROLLED_BACK"] += 1
            if not generation:
                raise errors.RolledBack(
                    f"{what} names no generation: a write must carry the pool's as the allocator last told its writer "
                    f"(the SDK's Client.generation(pool); the pool's is {self.generation})",
                    generation=self.generation or 0)
            raise errors.RolledBack(
                f"{what}: generation {generation} is not the pool's, {self.generation}: the Redis serving it restarted "
                f"or failed over, so its state may have rolled back; resynchronise with the allocator first",
                generation=self.generation or 0)

    async def _refresh_once(self) -> None:
        """One ``refresh`` for the writes waiting now (at most every MIN_REFRESH seconds)."""
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        asked = time.monotonic()
        async with self._refreshing:
            if self._refreshed_at >= asked or asked - self._refreshed_at < MIN_REFRESH:
                return      # (answered meanwhile, or just now)
            try:
                await self.refresh()
            finally:
                self._refreshed_at = time.monotonic()
