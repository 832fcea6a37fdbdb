"""A binary buddy allocator over an address space of slots.

This is how the simulator places the contiguous baselines' reservations: every request
gets one contiguous range whose size is its reservation rounded up to a power of two,
so both the rounding and the holes between live ranges are real.

The space ``0 .. capacity - 1`` is cut into power-of-two **regions**, largest first
(``capacity = 10`` gives regions of 8 and 2 at offsets 0 and 8). Each region is a buddy
system of its own: a free block of order ``k`` (``2**k`` slots) splits into two buddies of
order ``k - 1``; when both buddies are free again they merge. Blocks never merge across
regions. Free blocks are kept per order in a set (membership) and a heap (the lowest
offset first, with lazy deletion), so ``alloc`` and ``free`` cost O(log capacity) each.
Placement is deterministic. ``fit="first"`` (the default) takes the lowest-addressed free
block that is large enough, so live blocks pack towards address 0 and a freed block
stays a hole between its neighbours; ``fit="best"`` takes a block of the smallest order
that is large enough (the lowest-addressed of that order), sparing large blocks.

Example::

    b = Buddy(10)
    a = b.alloc(3)      # 0 (a block of 4)
    b.alloc(2)          # 4
    b.free(a)
    b.largest_free      # 4
"""

from __future__ import annotations

import bisect
import heapq


def order_of(size: int) -> int:
    """The order of the smallest power of two >= ``size`` (``size >= 1``)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return (size - 1).bit_length()


class Buddy:
    """A buddy allocator of ``capacity`` slots.

    Args:
        capacity: slots in the address space (>= 1; any integer).
        fit: ``"first"`` (lowest address) or ``"best"`` (smallest order) placement.

    Attributes:
        capacity: slots in the address space.
        regions: ``(offset, order)`` of each power-of-two region, by offset.
    """

    def __init__(self, capacity: int, *, fit: str = "first") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if fit not in ("first", "best"):
            raise ValueError(f"fit must be 'first' or 'best', got {fit!r}")
        self.capacity = capacity
        self.fit = fit
        self.regions: list[tuple[int, int]] = []
        top = capacity.bit_length()
        self._sets: list[set[int]] = [set() for _ in range(top)]
        self._heaps: list[list[int]] = [[] for _ in range(top)]
        start, rest = 0, capacity
        while rest:
            k = rest.bit_length() - 1
            self.regions.append((start, k))
            self._push(start, k)
            start += 1 << k
            rest -= 1 << k
        self._starts = [s for s, _ in self.regions]
        self._used: dict[int, int] = {}   # offset -> order of each allocated block
        self._free_slots = capacity

    # ------------------------------------------------------------ queries

    @property
    def free_slots(self) -> int:
        """Slots not in any allocated block."""
        return self._free_slots

    @property
    def used_slots(self) -> int:
        """Slots in allocated blocks (block sizes, i.e. after rounding)."""
        return self.capacity - self._free_slots

    @property
    def largest_free(self) -> int:
        """Size of the largest block that ``alloc`` could return now (0 if none)."""
        for k in range(len(self._sets) - 1, -1, -1):
            if self._sets[k]:
                return 1 << k
        return 0

    def size_of(self, offset: int) -> int:
        """Size of the allocated block at ``offset``."""
        try:
            return 1 << self._used[offset]
        except KeyError:
            raise KeyError(f"no allocated block at offset {offset}") from None

    def __len__(self) -> int:
        """Allocated blocks."""
        return len(self._used)

    # ------------------------------------------------------------ operations

    def alloc(self, size: int) -> int | None:
        """Allocates a block of ``size`` slots rounded up to a power of two.

        Args:
            size: slots wanted (>= 1).

        Returns:
            The block's offset, or None when no free block is large enough.
        """
        want = order_of(size)
        k = self._first(want) if self.fit == "first" else self._best(want)
        if k < 0:
            return None
        offset = self._pop(k)
        while k > want:          # split, keeping the lower half, freeing the upper
            k -= 1
            self._push(offset + (1 << k), k)
        self._used[offset] = want
        self._free_slots -= 1 << want
        return offset

    def free(self, offset: int) -> None:
        """Frees the block at ``offset`` and merges it with free buddies.

        Raises:
            KeyError: no allocated block starts at ``offset``.
        """
        try:
            k = self._used.pop(offset)
        except KeyError:
            raise KeyError(f"no allocated block at offset {offset}") from None
        self._free_slots += 1 << k
        base, top = self.regions[bisect.bisect_right(self._starts, offset) - 1]
        while k < top:
            buddy = base + ((offset - base) ^ (1 << k))
            if buddy not in self._sets[k]:
                break
            self._sets[k].discard(buddy)     # its heap entry goes stale
            offset = min(offset, buddy)
            k += 1
        self._push(offset, k)

    # ------------------------------------------------------------ internals

    def _best(self, want: int) -> int:
        for k in range(want, len(self._sets)):
            if self._sets[k]:
                return k
        return -1

    def _first(self, want: int) -> int:
        """The order of the lowest-addressed free block of order >= ``want`` (-1: none)."""
        best, where = -1, self.capacity
        for k in range(want, len(self._sets)):
            live = self._sets[k]
            if not live:
                continue
            heap = self._heaps[k]
            while heap[0] not in live:          # drop stale entries from the top
                heapq.heappop(heap)
            if heap[0] < where:
                best, where = k, heap[0]
        return best

    def _push(self, offset: int, k: int) -> None:
        self._sets[k].add(offset)
        heap = self._heaps[k]
        if len(heap) > 2 * len(self._sets[k]) + 64:   # too many stale entries: rebuild
            heap[:] = self._sets[k]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, offset)

    def _pop(self, k: int) -> int:
        heap, live = self._heaps[k], self._sets[k]
        while True:
            offset = heapq.heappop(heap)
            if offset in live:
                live.discard(offset)
                return offset

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, by offset."""
        return sorted((o, 1 << k) for k, s in enumerate(self._sets) for o in s)

    def check(self) -> None:
        """Checks every invariant; raises AssertionError with the first one broken.

        The free and allocated blocks tile ``0 .. capacity - 1`` exactly (no overlap, no
        gap); every block is aligned to its size inside one region; no two free buddies
        are left unmerged; ``free_slots`` equals the free blocks' sizes.
        """
        blocks = [(o, 1 << k, False) for k, s in enumerate(self._sets) for o in s]
        blocks += [(o, 1 << k, True) for o, k in self._used.items()]
        blocks.sort()
        at = 0
        for offset, size, _ in blocks:
            assert offset == at, f"{'gap' if offset > at else 'overlap'} at slot {at} (next block at {offset})"
            base, top = self.regions[bisect.bisect_right(self._starts, offset) - 1]
            assert offset + size <= base + (1 << top), f"block {offset}+{size} crosses its region"
            assert (offset - base) % size == 0, f"block {offset}+{size} not aligned in its region at {base}"
            at = offset + size
        assert at == self.capacity, f"blocks cover {at} of {self.capacity} slots"
        free = sum(size for _, size, used in blocks if not used)
        assert free == self._free_slots, f"free_slots {self._free_slots} != {free} in free blocks"
        for k, s in enumerate(self._sets):
            for o in s:
                base, top = self.regions[bisect.bisect_right(self._starts, o) - 1]
                if k < top:
                    buddy = base + ((o - base) ^ (1 << k))
                    assert buddy not in s, f"free buddies {min(o, buddy)} and {max(o, buddy)} of order {k} unmerged"
            assert s <= set(self._heaps[k]), f"order {k}: a free block missing from its heap"
