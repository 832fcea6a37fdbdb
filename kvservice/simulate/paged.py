"""The paged policies: this project's allocator itself, driven through the SDK.

Nothing here re-implements paging: each run registers a fresh pool on a real allocator
(``kvservice serve`` with its Redis) and drives it through the SDK in local mode, as the
engine does (DESIGN §5): a simulated step's frees, one-token appends and forks change the
client's block tables at once, taking blocks from the lease's reserve; then
``Client.flush()`` (the barrier) has the allocator apply them and refill the reserve, and
the step's creates make one synchronous call. The SDK's block tables are the ground truth
the accounting reads; after the flush they are also the allocator's.

- ``paged``: no sharing. Every sample is its own sequence holding the whole prompt, and
  each create carries a unique ``extra_key`` so the prefix cache never shares blocks
  between samples or requests.
- ``paged-shared``: one common ``extra_key``, so a prompt prefix that is common to the
  workload (a system prompt) is served by the prefix cache; a request with ``n > 1``
  samples is created once and forked in the next step, the children sharing the prompt's
  blocks (the allocator copies a shared partial last block on write).

Before each step the blocks it needs are predicted from the SDK's block tables (a new
block when a sample's last block is full, ``n - 1`` copies or ``n`` blocks at a fork, the
prompt's blocks at a create, less the prefix blocks live sequences already hold), so the
step does not fail. Growth takes reserve blocks first, then what the pool has free; a
create takes free blocks only (never the lease's reserve). Admission keeps free what the
running samples will need in the next step beyond the reserve (a one-step lookahead).
When the running samples' growth does not fit, the most recently admitted requests are
preempted: freed in the same step, and recomputed from their tokens so far when admitted
again (``paged``: each sample is created with its own tokens; ``paged-shared``: the
prompt is created and, in the next step, forked with each sample's own tokens). Should
the allocator still refuse the creates (RESOURCE_EXHAUSTED), that is counted and their
requests go back to the queue.

**The lease's reserve** holds blocks that are in no table: the allocator gave them to
this lease, so they are not free, and they hold no token either. After each step's flush
its size (``Client.reserved_blocks()``) is counted as a state of its own,
``reserved_unused``, beside the others (see ``runner``).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from kvservice import errors
from kvservice.client import Client
from kvservice.tools.launcher import AllocatorProcess
from kvservice.simulate.workload import output_token, tokens_so_far

if TYPE_CHECKING:
    from kvservice.simulate.runner import RunState


#: The flags of the simulator's own allocator. Every lease's reserve is capped at its size
#: under pressure (``reserve_min_blocks``, 4 blocks), which is what the default settings
#: give a pool whose free + evictable blocks are below 5%, i.e. a memory-bound run's
#: measured steps; a cap that moved with the pool's free blocks would make the reserve's
#: size after a step depend on when the SDK's background flusher ran, and runs would no
#: longer be deterministic.
#: The study's pools of 1-token blocks take creates and frees of thousands of blocks: the
#: per-call limits (which bound how long one call may stall Redis for the other callers,
#: docs/security.md) are raised for it, the only client of its allocator, so that each of
#: its operations is one script call (larger ones would go in parts, in another order).
ALLOCATOR_FLAGS = ("--metrics-port", "-1", "--log-level", "WARNING", "--reserve-pressure-share", "1",
                   "--max-items-per-call", "4096", "--max-blocks-per-call", "1048576",
                   "--max-release-per-call", "1048576", "--max-fork-refs-per-call", "1048576")


@contextmanager
def local_allocator(timeout: float = 60.0) -> Iterator[str]:
    """Starts an allocator process with an embedded Redis; yields its ``host:port``.

    Args:
        timeout: seconds to wait for it to serve.

    Yields:
        The allocator's target (flags: ``ALLOCATOR_FLAGS``); the process (and its Redis)
        stop when the block exits.
    """
    proc = AllocatorProcess(args=ALLOCATOR_FLAGS)
    proc.start(timeout)
    try:
        yield proc.target
    finally:
        proc.stop()


class PagedMemory:
    """A paged policy's KV memory: one fresh pool on a real allocator.

    Args:
        target: the allocator's ``host:port``.
        shared: ``paged-shared`` (prefix cache and forks) instead of ``paged``.
        capacity_tokens: slots; the pool gets ``capacity_tokens // block_size`` blocks.
        block_size: tokens per block.
        seed: seeds the token ids (see ``workload.prompt_tokens``).
        lookahead: admit only while the blocks that the running samples will need in the
            next step stay free (so an admission does not force a preemption one step
            later).

    Attributes:
        capacity: slots of the pool (``num_blocks * block_size``).
        used: blocks referenced by live sequences (predicted before a step, exact after).
        token, covered, allocated: the accounting totals in slots (see ``runner``).
        reserved: slots of the lease's reserve blocks (in no table) after the step's flush.
        peak_reserved: the most blocks in the reserve after a step.
        failures: preemption steps plus RESOURCE_EXHAUSTED replies.
        preemptions: requests preempted.
    """

    def __init__(self, target: str, *, shared: bool, capacity_tokens: int, block_size: int,
                 seed: int = 0, lookahead: bool = True) -> None:
        self.shared, self.block_size, self.seed = shared, block_size, seed
        self.num_blocks = capacity_tokens // block_size
        self.capacity = self.num_blocks * block_size
        self.client = Client(target, tenant=f"sim-{uuid.uuid4().hex[:12]}", lease_ttl=120.0, local=True)
        self.pool = f"sim-{'shared' if shared else 'paged'}-{block_size}-{uuid.uuid4().hex[:8]}"
        try:
            self.client.register_pool(self.pool, num_blocks=self.num_blocks, block_size=block_size)
        except BaseException:
            self.close()
            raise
        self.used = self.peak = 0
        self.reserved = self.peak_reserved = 0
        self._settled = False                 # this step's local changes are applied and flushed
        self.lookahead = lookahead
        self._next = 0                        # blocks the running samples need next step
        self._wanted = 0                      # blocks the last refused admission needed
        self.mispredicted = 0                 # shared: steps that took more blocks than predicted
        self.token = self.covered = self.allocated = 0
        self.failures = self.preemptions = self.exhausted = 0
        self._live: dict = {}                 # Sequence -> RunState
        self._ref: Counter = Counter()        # shared: block -> live holders
        self._sys: list[int] = []             # shared: blocks of the common prefix
        self._frees: list = []
        self._appends: dict = {}
        self._forks: dict = {}
        self._forking: list["RunState"] = []
        self._creates: list[tuple["RunState", int, int]] = []   # (request, sample, blocks needed)
        self._children: dict = {}             # this step's forks: parent id -> children

    # ------------------------------------------------------------ sizing

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def need_slots(self, r: "RunState") -> int:
        """Slots the last refused admission (``r``'s) needed free (the reserve aside)."""
        return self._wanted * self.block_size

    def fits_ever(self, r: "RunState") -> bool:
        """Whether ``r`` could run to its end alone in the empty pool."""
        if self.shared:
            prompt = r.req.prompt_len
            need = prompt // self.block_size + r.n * self._blocks(prompt % self.block_size + r.req.output_len)
        else:
            need = r.n * self._blocks(r.f)
        return need <= self.num_blocks

    # ------------------------------------------------------------ the step

    def _drop(self, r: "RunState") -> int:
        """Queues ``r``'s sequences for freeing; returns the blocks that become free."""
        released = 0
        for s in r.seqs:
            self._frees.append(s)
            del self._live[s]
            if self.shared:
                for b in s.block_table:
                    self._ref[b] -= 1
                    if not self._ref[b]:
                        del self._ref[b]
                        released += 1
            else:
                released += len(s.block_table)
                self.token -= s.num_tokens
                self.allocated -= s.capacity
                self.covered -= min(s.capacity, r.f)
        r.seqs = []
        self.used -= released
        return released

    def release(self, finished: list["RunState"]) -> None:
        """Frees completed requests (in this step's call)."""
        for r in finished:
            self._drop(r)

    def grow(self, running: dict[int, "RunState"], step: int) -> list["RunState"]:
        """Plans one token for every running sample; preempts if the blocks run short.

        Returns:
            The preempted requests, the most recently admitted first.
        """
        bs, need, wants = self.block_size, 0, {}
        for key, r in running.items():
            if r.fork_pending:
                k = self._fork_need(r)
            else:
                k = sum(1 for s in r.seqs if s.num_tokens == s.capacity)
            wants[key] = k
            need += k
        victims = []
        if need > self.num_blocks - self.used:
            self.failures += 1
            for key in reversed(running):
                if need <= self.num_blocks - self.used:
                    break
                r = running[key]
                need -= wants.pop(key)
                if not r.fork_pending:             # resumes from its tokens so far
                    r.t0 = r.seqs[0].num_tokens
                r.fork_pending = False
                self._drop(r)
                self.preemptions += 1
                victims.append(r)
        appends, forks = self._appends, self._forks
        nxt = 0
        for key, r in running.items():
            if key not in wants:
                continue
            rid = r.req.id
            if r.fork_pending:                     # every sample gets its tokens after the prompt
                parent = r.seqs[0]
                span = range(parent.num_tokens, r.t0 + 1)
                appends[parent] = [output_token(rid, 0, pos) for pos in span]
                forks[parent] = [[output_token(rid, i, pos) for pos in span] for i in range(1, r.n)]
                self._forking.append(r)
                r.fork_pending = False
                if (r.t0 + 1) % bs == 0 and r.t0 + 1 < r.f:
                    nxt += r.n
                continue
            for i, s in enumerate(r.seqs):
                t = s.num_tokens
                if (t + 1) % bs == 0 and t + 1 < r.f:
                    nxt += 1
                appends[s] = [output_token(rid, i, t)]
                if not self.shared and t == s.capacity:
                    self.allocated += bs
                    self.covered += min(bs, r.f - t)
            if not self.shared:
                self.token += len(r.seqs)
        self.used += need
        self._next = nxt
        return victims

    def _create_len(self, r: "RunState") -> int:
        """Tokens of each create: the prompt when samples are forked, else ``t0``."""
        return r.req.prompt_len if self.shared and r.n > 1 else r.t0

    def _fork_need(self, r: "RunState") -> int:
        """Blocks the fork step of a ``paged-shared`` request allocates.

        The prompt's full blocks stay shared; each sample then needs its own blocks up to
        ``t0 + 1`` tokens, a shared partial last block being copied for all but the last
        writer, which keeps it.
        """
        p, bs = r.req.prompt_len, self.block_size
        return r.n * (self._blocks(r.t0 + 1) - p // bs) - (1 if p % bs else 0)

    def admit(self, r: "RunState", step: int) -> bool:
        """Plans the creates of ``r`` if its blocks fit next to this step's growth.

        A ``paged-shared`` request with several samples also needs its fork step's blocks
        free (they are taken in the next step). With ``lookahead``, the blocks that the
        running samples will need in the next step are kept free too, as far as the
        lease's reserve does not cover them, so that an admission does not force a
        preemption one step later. The reserve's blocks are not free for the create.
        """
        bs, length = self.block_size, self._create_len(r)
        if self.shared:
            samples = 1
            need = self._blocks(length) - self._hits(r, length)
            later = self._fork_need(r) if r.n > 1 else int(length % bs == 0 and length < r.f)
        else:
            samples = r.n
            need = r.n * self._blocks(length)
            later = r.n * int(length % bs == 0 and length < r.f)
        ahead = self._next if self.lookahead else 0
        if self.shared and r.n > 1:
            ahead += later
        # The create takes free blocks; the next step's growth takes the reserve first.
        reserve = self._settle()
        wanted = need + max(0, ahead - reserve)
        if wanted > self.num_blocks - self.used - reserve:
            self._wanted = wanted
            return False
        self.used += need
        self._next += later
        for i in range(samples):
            self._creates.append((r, i, need if i == 0 else 0))
        r.fork_pending = self.shared and r.n > 1
        return True

    def _hits(self, r: "RunState", length: int) -> int:
        """Prefix blocks of a ``length``-token create that live sequences hold."""
        k = min(r.req.shared_prefix // self.block_size, (length - 1) // self.block_size, len(self._sys))
        return k if k and all(b in self._ref for b in self._sys[:k]) else 0

    def _settle(self) -> int:
        """Applies this step's frees, forks and appends (local, once per step), then flushes;
        returns the blocks in the lease's reserve.

        Three calls, so that the SDK sizes each one's reserve need exactly: the frees first
        (what they release serves the growth: a refill applies the journal before it takes
        blocks, but the SDK sizes a step's need before applying the step's own frees), then
        the forks (each child copies the shared partial block it writes), then the appends
        (a fork's parent, the last writer, keeps its block).
        """
        if not self._settled:
            self._settled = True
            self.client.step(frees=self._frees)
            res = self.client.step(forks=self._forks)
            self.client.step(self._appends)
            self._children = res.children
            self.client.flush()
            self.reserved = self.client.reserved_blocks() * self.block_size
            self.peak_reserved = max(self.peak_reserved, self.reserved // self.block_size)
        return self.reserved // self.block_size

    def flush(self, step: int) -> list["RunState"]:
        """Ends the step: its local changes (if no admission did yet) and its creates (one
        synchronous call); returns requests the allocator could not admit."""
        self._settle()
        creates = []
        for r, i, _ in self._creates:
            key = b"shared" if self.shared else f"{r.req.id}/{i}".encode()
            creates.append((tokens_so_far(r.req, self.seed, i, self._create_len(r)), self.pool, key))
        refused: list["RunState"] = []
        created = []
        if creates:
            try:
                created = self.client.step(creates=creates).created
            except errors.ResourceExhausted:   # one pool: all of them or none
                self.failures += 1
                self.exhausted += 1
                refused = list(dict.fromkeys(r for r, _, _ in self._creates))
                for r, _, need in self._creates:
                    self.used -= need
                    r.fork_pending = False
                self._creates = []
        for (r, _, _), seq in zip(self._creates, created):
            r.seqs.append(seq)
            self._live[seq] = r
            if not self.shared:
                self.token += seq.num_tokens
                self.allocated += seq.capacity
                self.covered += min(seq.capacity, r.f)
        for r in self._forking:
            parent = r.seqs[0]
            r.seqs = [parent, *self._children[parent.id]]
            for s in r.seqs[1:]:
                self._live[s] = r
        if self.shared:
            predicted = self.used
            self._recount()
            self.mispredicted += self.used > predicted
            if self._creates and not self._sys_live():
                self._remember_prefix()
        self.peak = max(self.peak, self.used)
        self._frees, self._appends, self._forks, self._forking, self._creates = [], {}, {}, [], []
        self._children, self._settled = {}, False
        return refused

    def _sys_live(self) -> bool:
        return bool(self._sys) and all(b in self._ref for b in self._sys)

    def _remember_prefix(self) -> None:
        for r, _, _ in self._creates:
            k = min(r.req.shared_prefix, self._create_len(r) - 1) // self.block_size
            if k and r.seqs:
                self._sys = r.seqs[0].block_table[:k]
                return

    def _recount(self) -> None:
        """Shared accounting from the block tables: each physical block counted once."""
        bs, ref, last = self.block_size, Counter(), {}
        for s, r in self._live.items():
            table = s.block_table
            ref.update(table)
            start = (len(table) - 1) * bs
            filled, future = s.num_tokens - start, min(bs, r.f - start)
            f0, u0 = last.get(table[-1], (0, 0))
            last[table[-1]] = (max(f0, filled), max(u0, future))
        self._ref, self.used = ref, len(ref)
        self.allocated = self.used * bs
        self.token = self.allocated - sum(bs - f for f, _ in last.values())
        self.covered = self.allocated - sum(bs - u for _, u in last.values())

    @property
    def logical_blocks(self) -> int:
        """Block-table entries summed over live sequences."""
        if self.shared:
            return sum(self._ref.values())
        return self.allocated // self.block_size

    # ------------------------------------------------------------ checks and end

    def check(self, running: dict[int, "RunState"], step: int) -> None:
        """Debug: local totals against the tables and the allocator's own count."""
        bs = self.block_size
        assert not self.mispredicted, f"{self.mispredicted} step(s) took more blocks than predicted"
        for r in running.values():
            t = self._create_len(r) if r.fork_pending else r.t0 + step - r.admitted
            assert len(r.seqs) == (1 if r.fork_pending else r.n), f"request {r.req.id}: {len(r.seqs)} sequences"
            for s in r.seqs:
                assert s.num_tokens == t, f"request {r.req.id}: {s.num_tokens} tokens, expected {t}"
                assert len(s.block_table) == self._blocks(t), f"request {r.req.id}: table {s.block_table}"
        if not self.shared:
            seqs = [(s, r) for s, r in self._live.items()]
            token = sum(s.num_tokens for s, _ in seqs)
            allocated = sum(s.capacity for s, _ in seqs)
            covered = sum(min(s.capacity, r.f) for s, r in seqs)
            assert (token, covered, allocated) == (self.token, self.covered, self.allocated), (
                f"totals {(self.token, self.covered, self.allocated)} != {(token, covered, allocated)}")
            assert self.used * bs == allocated
        stats, reserved = self._settled_counts()
        assert stats.num_used_blocks == self.used <= self.num_blocks - reserved, (
            f"allocator: {stats.num_used_blocks} used blocks, local {self.used}, "
            f"{reserved} reserved, of {self.num_blocks}")
        assert stats.num_reserved_blocks == reserved, (
            f"allocator: {stats.num_reserved_blocks} reserved blocks, the SDK {reserved}")

    def _settled_counts(self) -> tuple[Any, int]:
        """The pool's stats and the SDK's reserve, read when no Sync is on its way (a
        background refill may be granted in the pool before its reply reaches the SDK):
        the two are read again until the SDK's reserve is the same before and after."""
        for _ in range(100):
            self.client.flush()
            mine = self.client.reserved_blocks()
            stats = self.client.pool_stats(self.pool)
            if stats.num_reserved_blocks == mine == self.client.reserved_blocks():
                break
            time.sleep(0.01)
        return stats, mine

    def finish(self) -> dict:
        """Frees whatever is live, then audits the pool."""
        if self._live:
            self.client.step(frees=list(self._live))
            self._live.clear()
        self.client.flush()
        audit = self.client.audit(self.pool)
        stats = self.client.pool_stats(self.pool)
        return {"audit_ok": bool(audit.ok), "audit_problems": list(audit.problems),
                "num_used_blocks": int(stats.num_used_blocks), "peak_blocks": self.peak,
                "pool_id": self.pool, "exhausted": self.exhausted, "cow_copies": int(stats.cow_copies),
                "prefix_hit_tokens": int(stats.prefix_hit_tokens), "evictions": int(stats.evictions),
                "peak_reserved_blocks": self.peak_reserved}

    def close(self) -> None:
        """Revokes the lease (its sequences, if any, are freed with it)."""
        self.client.close()
