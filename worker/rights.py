"""Which lease may read and write which block of this worker's pool, as the allocator's
grants say (``kvservice/common/grants.py``, docs/security.md "Grants").

The table is built from the grants that callers present with their calls; each is
verified once under the pool's grant key of the current epoch and applied:

- a block a grant lets its lease **write** has that lease as its writer, from that grant's
  serial on: the readers it had under older grants are dropped (the block changed hands);
  a grant older than the block's current writer's is ignored for that block;
- a block a grant lets its lease **read** gets that lease as a reader, unless the grant is
  older than the block's current writer's.

A call then passes when every block it writes has the calling lease as its writer and
every block it reads has it as its writer or a reader. A lease that the worker knows dead
(``LeaseFence``) is forgotten here too; a new epoch (a new key) clears the table.

When a block goes to a lease of another tenant than its last writer's, the worker zeroes
it before the new writer's call runs (``admit`` returns those blocks): a tenant that
reads a block it was given before writing it reads zeros, never another tenant's K/V.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvservice import errors
from kvservice.common.grants import Grant, move_fields, order_valid, pull_fields
from kvservice.common.settings import echo


def _ids(data: bytes, what: str) -> np.ndarray:
    """A grant's block ids (``grants.pack_blocks``' little-endian uint32) as int64."""
    if len(data) % 4:
        raise errors.InvalidArgument(f"{what}: {len(data)} bytes is not a whole number of 4-byte block ids")
    return np.frombuffer(data, dtype="<u4").astype(np.int64)


class BlockRights:
    """The grants a worker has seen for its pool, per block (see the module).

    Args:
        num_blocks: the pool's blocks.
        pool_id: the pool's id (a grant of another pool is refused).
    """

    def __init__(self, num_blocks: int, pool_id: str) -> None:
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.epoch = 0
        self._key = b""
        self._writer = np.full(num_blocks, -1, dtype=np.int64)     # a lease's index, -1: none
        self._since = np.zeros(num_blocks, dtype=np.int64)          # the serial of the writer's grant
        self._readers: dict[int, dict[int, int]] = {}               # block -> {lease index: serial}
        self._index: dict[str, int] = {}                            # lease id -> index
        self._next = 0
        # The tenant whose K/V a block may hold (its last writer's; -1: none since the
        # process started). Kept across epochs: the memory is.
        self._tenants: dict[str, int] = {}
        self._content = np.full(num_blocks, -1, dtype=np.int64)
        # The serial of the grant under which each block was last written (or zeroed): a
        # copy down ordered as of a serial no newer than that would copy other bytes than
        # the order's hash names.
        self._written = np.zeros(num_blocks, dtype=np.int64)
        #: Grants refused (a bad MAC, another pool or epoch, another tenant's).
        self.refused = 0
        #: Calls refused for a block no grant of theirs covers.
        self.denied = 0

    def reset(self, epoch: int, key: bytes) -> None:
        """A new epoch and its key: every grant seen so far is void."""
        self.epoch, self._key = epoch, key
        self._written.fill(0)
        self.clear()

    def clear(self) -> None:
        """Voids every grant seen so far (a new generation: the pool's state may have
        rolled back, and its holders get new grants as they resynchronise)."""
        self._writer.fill(-1)
        self._since.fill(0)
        self._readers.clear()
        self._index.clear()

    @property
    def enforced(self) -> bool:
        """Whether calls are checked (the pool is registered and has a grant key)."""
        return bool(self._key)

    def admit(self, grants: Iterable, caller_tenant: str | None, generation: int | None, what: str) -> list[int]:
        """Verifies and applies ``grants`` (``Grant`` or its proto); returns the blocks
        that changed tenant (to be zeroed before the call runs).

        ``caller_tenant``: the authenticated caller's tenant (None: a worker that
        authenticates nobody). ``generation``: the pool's, as the worker knows it (None:
        not checked).

        Raises:
            PermissionDenied: a grant that is not the allocator's (a bad MAC), of another
                pool, or of another tenant than the caller.
            FailedPrecondition: a grant of another epoch (EPOCH_CHANGED) or generation
                (ROLLED_BACK).
        """
        zero: list[int] = []
        for i, g in enumerate(grants):
            grant = g if isinstance(g, Grant) else Grant.from_pb(g)
            self._verify(grant, caller_tenant, generation, f"{what}: grants[{i}]")
            zero.extend(self._apply(grant))
        if zero:                                    # (zeroed before the call runs: written)
            self._written[zero] = self._since[zero]
        return zero

    def _verify(self, g: Grant, caller_tenant: str | None, generation: int | None, what: str) -> None:
        if g.pool_id != self.pool_id:
            self.refused += 1
            raise errors.PermissionDenied(f"{what} is for pool {echo(g.pool_id)}, not this worker's {self.pool_id}")
        if g.epoch != self.epoch:
            self.refused += 1
            raise errors.FailedPrecondition(f"{what} is of epoch {g.epoch}, but pool {self.pool_id} is at epoch "
                                            f"{self.epoch}", reason="EPOCH_CHANGED")
        if not g.valid(self._key):
            self.refused += 1
            raise errors.PermissionDenied(f"{what}: not signed by the allocator for pool {self.pool_id} at epoch "
                                          f"{self.epoch} (a grant cannot be made or changed by its holder)")
        if caller_tenant is not None and g.tenant != caller_tenant:
            self.refused += 1
            raise errors.PermissionDenied(f"{what} is tenant {echo(g.tenant)}'s, and the caller is "
                                          f"{echo(caller_tenant)}: a grant is used only by the tenant it names")
        if generation is not None and g.generation != generation:
            self.refused += 1
            raise errors.RolledBack(f"{what} is of generation {g.generation}, not the pool's {generation}: "
                                    f"resynchronise with the allocator first", generation=generation)

    def _lease(self, lease_id: str) -> int:
        idx = self._index.get(lease_id)
        if idx is None:
            idx = self._index[lease_id] = self._next
            self._next += 1
        return idx

    def _apply(self, g: Grant) -> list[int]:
        idx = self._lease(g.lease_id)
        tenant = self._tenants.setdefault(g.tenant, len(self._tenants))
        write = self._blocks(_ids(g.write, "write_blocks"), "write_blocks")
        read = self._blocks(_ids(g.read, "read_blocks"), "read_blocks")
        newer = write[g.serial > self._since[write]]
        content = self._content[newer]
        zero = newer[(content >= 0) & (content != tenant)].tolist()
        if newer.size:
            self._content[newer] = tenant
            for b in newer.tolist():
                readers = self._readers.get(b)
                if readers:
                    kept = {r: s for r, s in readers.items() if s > g.serial}
                    if kept:
                        self._readers[b] = kept
                    else:
                        del self._readers[b]
            self._writer[newer] = idx
            self._since[newer] = g.serial
        for b in read[g.serial > self._since[read]].tolist():
            self._readers.setdefault(b, {})[idx] = g.serial
        return zero

    def _blocks(self, blocks: np.ndarray, what: str) -> np.ndarray:
        if blocks.size and blocks.max() >= self.num_blocks:
            raise errors.InvalidArgument(f"{what}: block {int(blocks.max())} is out of range "
                                         f"0..{self.num_blocks - 1}")
        return blocks

    def check(self, lease_id: str, write: Iterable[int] = (), read: Iterable[int] = (), what: str = "") -> None:
        """Raises unless ``lease_id`` may write every block of ``write`` and read every
        block of ``read`` (a block it may write it may read).

        Raises:
            PermissionDenied: a block the lease was not granted, or was granted and has
                changed hands since (the first such block is named).
        """
        if not self.enforced:
            return
        w = np.fromiter(write, dtype=np.int64)
        refusal = self._first_refusal(lease_id, w, read, what)
        if refusal:
            self.denied += 1
            raise errors.PermissionDenied(refusal)
        if w.size:
            w = w[(w >= 0) & (w < self.num_blocks)]
            self._written[w] = self._since[w]

    def _first_refusal(self, lease_id: str, w: np.ndarray, read: Iterable[int], what: str) -> str:
        idx = self._index.get(lease_id, -2)
        if w.size:
            w = w[(w >= 0) & (w < self.num_blocks)]         # (out of range: the pool's own checks say so)
            bad = w[self._writer[w] != idx]
            if bad.size:
                return self._refusal(lease_id, int(bad[0]), "write", what)
        r = np.fromiter(read, dtype=np.int64)
        if r.size:
            r = r[(r >= 0) & (r < self.num_blocks)]
            for b in np.unique(r[self._writer[r] != idx]).tolist():
                if idx not in self._readers.get(b, ()):
                    return self._refusal(lease_id, b, "read", what)
        return ""

    def _refusal(self, lease_id: str, block: int, right: str, what: str) -> str:
        lease = f"lease {echo(lease_id)}" if lease_id else "a call that names no lease"
        return (f"{what}: {lease} may not {right} block {block} of pool {self.pool_id}: no grant of the allocator "
                f"gives it that block (it was never granted to the lease, or has been granted to another since); "
                f"send the grants the allocator returned with the blocks")

    def pull_refusal(self, dst_pool: str, epoch: int, blocks: Iterable) -> str:
        """Why a pull of ``blocks`` (``BlockRef``s) of this pool at ``epoch`` for pool
        ``dst_pool`` is refused ("" when it is not): a block whose fetch order (its MAC under
        this pool's key over ``grants.pull_fields``) is missing or not the allocator's, or
        a device block that a writer was granted after the order's serial (it may hold other
        bytes than the ones the order was for). A refused pull serves nothing."""
        if not self.enforced:
            return ""
        for i, b in enumerate(blocks):
            fields = pull_fields(self.pool_id, epoch, dst_pool, b.pull_serial, b.tier, b.index, b.block_hash)
            if not order_valid(self._key, "pull", fields, b.order_mac):
                self.refused += 1
                return (f"blocks[{i}] ({'device block' if b.tier == 0 else 'entry'} {b.index} of tier {b.tier}) has no "
                        f"fetch order of the allocator for pool {echo(dst_pool) or '(none)'} from pool {self.pool_id} "
                        f"at epoch {epoch} (a pull names only the blocks its fetch orders name, with their order_mac)")
            if b.tier == 0 and 0 <= b.index < self.num_blocks and self._since[b.index] > b.pull_serial:
                self.denied += 1
                return (f"blocks[{i}] (device block {b.index}): its fetch order is older than the block's last grant "
                        f"to a writer (serial {b.pull_serial} < {int(self._since[b.index])}): the block may hold "
                        f"other bytes now; fetch it again with a new order")
        return ""

    def move_refusal(self, moves: Iterable) -> str:
        """Why MoveBlocks' ``moves`` (``BlockMove``s) are refused ("" when they are not): a
        move that is not the allocator's order (its MAC under this pool's key over
        ``grants.move_fields``). A refused call runs no move."""
        if not self.enforced:
            return ""
        for i, m in enumerate(moves):
            fields = move_fields(self.pool_id, self.epoch, m.serial, m.src_tier, m.src, m.dst_tier, m.dst, m.block_hash)
            if not order_valid(self._key, "move", fields, m.order_mac):
                self.refused += 1
                return (f"moves[{i}] (tier {m.src_tier} {'block' if m.src_tier == 0 else 'entry'} {m.src} -> tier "
                        f"{m.dst_tier} {'block' if m.dst_tier == 0 else 'entry'} {m.dst}) is not an order of the "
                        f"allocator for pool {self.pool_id} at epoch {self.epoch} (a move runs only as the allocator "
                        f"ordered it, with its order_mac)")
        return ""

    def stale_copies(self, moves: list) -> dict[int, str]:
        """The moves (by index) that copy a device block written, or zeroed, under a grant as
        new as the order's serial: its bytes are no longer the ones the order's hash names,
        and the move fails (the allocator drops the entry when it is settled)."""
        out = {}
        if not self.enforced:
            return out
        for i, m in enumerate(moves):
            if m.src_tier == 0 and 0 <= m.src < self.num_blocks and self._written[m.src] >= m.serial:
                out[i] = (f"device block {m.src} was written after this copy was ordered (serial {m.serial}, written "
                          f"under {int(self._written[m.src])}): not copied")
        return out

    def forget(self, lease_ids: Iterable[str]) -> None:
        """Drops dead leases (their blocks go to others with newer grants)."""
        gone = {self._index.pop(lease, -1) for lease in lease_ids} - {-1}
        if not gone:
            return
        self._writer[np.isin(self._writer, list(gone))] = -1
        for b in list(self._readers):
            readers = self._readers[b]
            for idx in gone & readers.keys():
                del readers[idx]
            if not readers:
                del self._readers[b]

    def holders(self) -> int:
        """Leases the table knows."""
        return len(self._index)


__all__ = ["BlockRights"]


def bench(num_blocks: int = 65_536, sequences: int = 32, blocks_per_sequence: int = 64, repeat: int = 2000) -> dict:
    """What the check costs a worker: admitting one grant (its MAC and the table's update)
    and checking a step's blocks (``sequences`` tables of ``blocks_per_sequence`` blocks
    read, one block written per sequence, half of each table shared with other leases),
    in microseconds per call (the median of ``repeat``)."""
    import statistics
    import time

    from kvservice.common.grants import new_key, pack_blocks

    key = new_key()
    rights = BlockRights(num_blocks, "bench")
    rights.reset(1, key)
    per = blocks_per_sequence
    own = list(range(sequences * per))
    shared = list(range(sequences * per, sequences * per + per // 2))
    rights.admit([Grant("bench", 1, 1, "other", "t", 1, pack_blocks(shared)).signed(key)], "t", 1, "bench")
    grant = Grant("bench", 1, 1, "L", "t", 2, pack_blocks(own), pack_blocks(shared)).signed(key)
    small = Grant("bench", 1, 1, "L", "t", 3, pack_blocks(own[:per])).signed(key)
    tables = [shared + own[i * per:i * per + per - per // 2] for i in range(sequences)]
    read = [b for t in tables for b in t]
    write = [t[-1] for t in tables]

    def median_us(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    return {"admit_grant_of_64_blocks_us": median_us(lambda: rights.admit([small], "t", 1, "bench")),
            f"admit_grant_of_{len(own) + len(shared)}_blocks_us": median_us(lambda: rights.admit([grant], "t", 1,
                                                                                                   "bench")),
            f"check_step_{sequences}x{per}_blocks_us": median_us(lambda: rights.check("L", write, read, "bench")),
            "blocks_read_per_step": len(read)}


if __name__ == "__main__":      # python -m worker.rights: the figures of ``bench``
    import json

    print(json.dumps({k: round(v, 1) for k, v in bench().items()}, indent=2))
