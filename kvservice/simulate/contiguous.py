"""The contiguous baselines: one reservation per sample, placed by a buddy allocator.

A serving system without paging must give each sequence one contiguous range of KV slots
for its whole life, sized before it is known how long the sequence will get. The three
policies differ only in that size (``reservation``):

- ``max``: the model's maximum length, whatever the request;
- ``pow2``: the prompt plus the output length rounded up to a power of two (so at most
  twice the output), capped at the maximum length;
- ``oracle``: exactly prompt plus output (an engine that knew the future).

Each reservation is then placed by ``Buddy``, which rounds it up to a power of two and
can fail while enough slots are free in total (external fragmentation). A request with
``n`` samples holds ``n`` ranges, taken all at once or not at all.

``ContiguousMemory`` is the memory model that ``kvservice.simulate.runner`` drives; it
keeps the accounting totals incrementally (O(1) per step, O(log capacity) per admission).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvservice.simulate.buddy import Buddy, order_of

if TYPE_CHECKING:
    from kvservice.simulate.runner import RunState

POLICIES = ("max", "pow2", "oracle")


def reservation(policy: str, prompt_len: int, output_len: int, max_len: int) -> int:
    """Slots a contiguous policy reserves for one sample (before buddy rounding).

    Args:
        policy: ``max``, ``pow2`` or ``oracle``.
        prompt_len: prompt tokens.
        output_len: tokens the sample will generate.
        max_len: the model's maximum length.

    Returns:
        The reservation in slots (>= prompt + output when that is <= max_len).
    """
    if policy == "max":
        return max_len
    if policy == "pow2":
        return min(prompt_len + (1 << order_of(output_len)), max_len)
    if policy == "oracle":
        return prompt_len + output_len
    raise ValueError(f"unknown contiguous policy {policy!r}; choose from {', '.join(POLICIES)}")


class ContiguousMemory:
    """A contiguous policy's KV memory: a buddy allocator plus running totals.

    Args:
        policy: ``max``, ``pow2`` or ``oracle``.
        capacity_tokens: slots in the address space.
        max_len: the model's maximum length.

    Attributes:
        capacity: slots (= ``capacity_tokens``).
        token: slots holding tokens, summed over live samples.
        covered: ``min(A, f)`` summed over live samples (A: block size, f: final length).
        allocated: slots of allocated blocks.
        reserved: slots held in reserve outside any sequence: none (paged runs: the lease's
            reserve).
        failures: refusals this memory counted itself (none: the runner counts waits).
        preemptions: always 0 (a reservation never has to grow).
    """

    block_size = 1

    def __init__(self, policy: str, *, capacity_tokens: int, max_len: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown contiguous policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        self.max_len = max_len
        self.capacity = capacity_tokens
        self.buddy = Buddy(capacity_tokens)
        self.token = self.covered = self.allocated = 0
        self.reserved = 0
        self.failures = self.preemptions = 0
        self.running_seqs = 0
        self._blocks_of: dict[int, int] = {}   # order -> how many such blocks fit when empty

    # ------------------------------------------------------------ sizing

    def block(self, r: "RunState") -> int:
        """The buddy block size of one of ``r``'s samples."""
        req = r.req
        return 1 << order_of(reservation(self.policy, req.prompt_len, req.output_len, self.max_len))

    def need_slots(self, r: "RunState") -> int:
        """Slots ``r`` needs at admission (all its samples' blocks)."""
        return r.n * self.block(r)

    def fits_ever(self, r: "RunState") -> bool:
        """Whether ``r``'s blocks could be placed in the empty address space."""
        k = order_of(self.block(r))
        if k not in self._blocks_of:
            self._blocks_of[k] = sum(1 << (top - k) for _, top in self.buddy.regions if top >= k)
        return r.n <= self._blocks_of[k]

    # ------------------------------------------------------------ the step

    def release(self, finished: list["RunState"]) -> None:
        """Frees the blocks of requests that completed (each sample holds ``f`` tokens)."""
        for r in finished:
            size = self.block(r)
            for offset in r.slots:
                self.buddy.free(offset)
            self.token -= r.n * r.f
            self.covered -= r.n * min(size, r.f)
            self.allocated -= r.n * size
            self.running_seqs -= r.n
            r.slots = []

    def grow(self, running: dict[int, "RunState"], step: int) -> list["RunState"]:
        """Every running sample gains one token; reservations never need more room."""
        self.token += self.running_seqs
        return []

    def admit(self, r: "RunState", step: int) -> bool:
        """Places ``r``'s ``n`` blocks; all or nothing."""
        size = self.block(r)
        got = []
        for _ in range(r.n):
            offset = self.buddy.alloc(size)
            if offset is None:
                for o in got:
                    self.buddy.free(o)
                return False
            got.append(offset)
        r.slots = got
        self.token += r.n * r.t0
        self.covered += r.n * min(size, r.f)
        self.allocated += r.n * size
        self.running_seqs += r.n
        return True

    def flush(self, step: int) -> list["RunState"]:
        """Nothing to send: every change is local."""
        return []

    @property
    def logical_blocks(self) -> int:
        """Not meaningful for contiguous placement (0)."""
        return 0

    # ------------------------------------------------------------ checks and end

    def check(self, running: dict[int, "RunState"], step: int) -> None:
        """Debug: the buddy's invariants and the totals recomputed from scratch."""
        self.buddy.check()
        token = covered = allocated = 0
        for r in running.values():
            size = self.block(r)
            assert len(r.slots) == r.n and all(self.buddy.size_of(o) == size for o in r.slots)
            t = r.t0 + step - r.admitted
            token += r.n * t
            covered += r.n * min(size, r.f)
            allocated += r.n * size
        assert (token, covered, allocated) == (self.token, self.covered, self.allocated), (
            f"totals {(self.token, self.covered, self.allocated)} != recomputed {(token, covered, allocated)}")
        assert allocated == self.buddy.used_slots <= self.capacity

    def finish(self) -> dict:
        """End-of-run facts: everything must be free again."""
        self.buddy.check()
        return {"audit_ok": self.buddy.free_slots == self.capacity and len(self.buddy) == 0,
                "num_used_blocks": len(self.buddy), "peak_blocks": 0}

    def close(self) -> None:
        """Nothing to release."""
