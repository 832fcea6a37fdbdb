"""The worker's fence against writes of dead leases (docs/security.md).

A lease that expired or was revoked has had its sequences freed: its blocks may already
hold another sequence's K/V. The allocator tells the worker those leases with each
heartbeat reply (``HeartbeatResponse.dead_leases``); every write (WriteKV, CopyBlocks,
Forward) names its lease and is refused, FAILED_PRECONDITION with reason LEASE_EXPIRED,
once the worker knows it dead: within one heartbeat interval (plus the allocator's reap
interval) of its death.
"""

from __future__ import annotations

import time

from kvservice import errors
from kvservice.common.settings import echo

#: How long a dead lease is remembered (the allocator keeps its tombstones an hour).
REMEMBER_SECONDS = 3600.0
#: At most this many dead leases are remembered (the oldest are forgotten first).
MAX_REMEMBERED = 1 << 20


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

    def __len__(self) -> int:
        return len(self._dead)

    def learn(self, dead_leases: list[str], dead_until_ms: int) -> None:
        """Adds the leases a heartbeat reply named, and moves the cursor."""
        now = time.monotonic()
        for lease in dead_leases:
            self._dead[lease] = now
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
            raise errors.LeaseExpired(f"{what}: lease {echo(lease_id)} expired or was revoked; its blocks may "
                                      f"belong to another sequence now")
