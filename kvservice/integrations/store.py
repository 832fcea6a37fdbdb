"""A KV store over kvservice (DESIGN §15): store workers (K/V-only workers registered with
role "store") hold the bytes, the allocator indexes them by its chained block hashes, per
tenant. What an external engine's connector needs, in four calls:

- ``hold(tokens)``: a create in a store pool (placed by the allocator among the store's
  pools, by cached prefix and load) that shares the prompt's cached prefix (its blocks
  cannot be evicted while held) and allocates blocks for the rest, whose hashes are
  deferred (``CreateOp.defer_commits``): nobody hits them before they are written;
- ``read(held, first, count)``: the bytes of held blocks, from their store worker;
- ``write(held, first, tokens, data)``: writes blocks, then commits their hashes and lets
  the sequence go (its blocks stay cached by hash until evicted);
- ``release(held)``: lets a held sequence go without writing.

A block's bytes are opaque to the store: the connector's layout, of
``bytes_per_block`` bytes (the store pool's). Everything hangs off one lease (``Client``):
a connector that dies leaves nothing held after its TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Sequence as Seq

from kvservice import errors
from kvservice.channel import open_channel
from kvservice.client import Client, new_request_id
from kvservice.common.geometry import Geometry
from kvservice.common.security import ClientCredentials
from kvservice.v1 import allocator_pb2 as pb, allocator_pb2_grpc as pb_grpc, worker_pb2_grpc as wpb_grpc
from worker import store as worker_store

_log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """A prompt's sequence in a store pool (``KVStore.hold``)."""

    sequence_id: str
    pool_id: str
    epoch: int
    generation: int
    block_table: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int           # the prefix the store holds (whole blocks)
    num_committed_blocks: int        # = num_cached_tokens / block_size
    last_hash: bytes
    lease_id: str
    #: The allocator's grants of its blocks (serialized ``kvservice.v1.Grant``): they go with
    #: the worker calls that read and write them.
    grants: tuple[bytes, ...] = ()

    def grant_messages(self) -> list[pb.Grant]:
        return [pb.Grant.FromString(g) for g in self.grants]


@dataclasses.dataclass(slots=True)
class _Pool:
    epoch: int
    block_size: int
    bytes_per_block: int
    stub: Any


class KVStore:
    """The store, as one client (one lease) sees it.

    Args:
        target: the allocator (``host:port``, several comma-separated).
        tenant: the lease's tenant (empty: the caller's identity).
        credentials: token / TLS (default: the ``KVSERVICE_*`` variables).
        extra_key: mixed into every chain of hashes (the model and the block layout: two
            engines share blocks only when it is equal).
        lease: grant a lease (the side that holds sequences); False: ``write`` and
            ``release`` act on the ``lease_id`` of the ``Held`` they are given.
        lease_ttl: seconds the allocator keeps a silent client's sequences.
        timeout: per-RPC deadline (seconds).
    """

    def __init__(self, target: str, *, tenant: str = "", credentials: ClientCredentials | None = None,
                 extra_key: bytes = b"", lease: bool = True, lease_ttl: float = 10.0, timeout: float = 10.0) -> None:
        self.credentials = credentials or ClientCredentials.from_env()
        self.extra_key = extra_key
        self.timeout = timeout
        self.client = Client(target, tenant=tenant, lease_ttl=lease_ttl, timeout=timeout,
                             credentials=self.credentials) if lease else None
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._target = target

    # ------------------------------------------------------------ allocator side

    def _stub(self):
        if self.client is not None:
            return self.client
        with self._lock:
            if not hasattr(self, "_calls"):
                self._calls = _Calls(self._target, self.credentials, self.timeout)
            return self._calls

    def pools(self) -> list[pb.Pool]:
        """The store's pools (role "store")."""
        return [p for p in self._stub().pools() if p.role == "store"]

    def hold(self, tokens: Seq[int]) -> Held | None:
        """A sequence for ``tokens`` in a store pool; None when no store pool can take it
        (none registered, or none with room): the caller goes on without the store."""
        c = self.client
        assert c is not None, "hold needs a lease"
        try:
            reply = c._call(c.stub.Step, pb.StepRequest(
                lease_id=c.lease_id, request_id=new_request_id(),
                creates=[pb.CreateOp(token_ids=tokens, extra_key=self.extra_key, pool_role="store",
                                     defer_commits=True)]))
        except (errors.ResourceExhausted, errors.FailedPrecondition) as exc:
            _log.info("kvservice store: no room for a prompt of %d tokens: %s", len(tokens), exc)
            return None
        s = reply.created[0]
        pool = self._pool(s.pool_id, s.epoch)
        return Held(s.sequence_id, s.pool_id, s.epoch, reply.generations.get(s.pool_id, 0), tuple(s.block_table),
                    s.num_tokens, s.num_cached_tokens, s.num_committed_blocks, s.last_hash, c.lease_id,
                    tuple(g.SerializeToString() for g in reply.grants)) \
            if pool else None

    def release(self, held: Held) -> None:
        """Lets ``held`` go without writing (its cached prefix stays cached)."""
        calls = self._stub()
        calls._call(calls.stub.FreeSequences, pb.FreeSequencesRequest(
            lease_id=held.lease_id, request_id=new_request_id(), sequence_ids=[held.sequence_id]))

    # ------------------------------------------------------------ store workers

    def _pool(self, pool_id: str, epoch: int) -> _Pool:
        with self._lock:
            known = self._pools.get(pool_id)
            if known is not None and known.epoch == epoch:
                return known
        calls = self._stub()
        p = calls._call(calls.stub.DescribePool, pb.DescribePoolRequest(pool_id=pool_id), idempotent=True)
        if not p.worker_address:
            raise errors.FailedPrecondition(f"store pool {pool_id} has no worker address")
        g = Geometry.from_pb(p.geometry)
        pool = _Pool(p.epoch, g.block_size, g.bytes_per_block,
                     wpb_grpc.WorkerStub(self.credentials.channel(p.worker_address, list(worker_store.CHANNEL_OPTIONS))))
        with self._lock:
            self._pools[pool_id] = pool
        return pool

    def geometry(self, held: Held) -> tuple[int, int]:
        """(block_size, bytes_per_block) of ``held``'s pool."""
        pool = self._pool(held.pool_id, held.epoch)
        return pool.block_size, pool.bytes_per_block

    def read(self, held: Held, first: int, count: int) -> bytearray:
        """The bytes of ``held``'s blocks ``first`` .. ``first + count - 1`` (cached ones),
        checked against their checksums."""
        pool = self._pool(held.pool_id, held.epoch)
        return worker_store.read_blocks(pool.stub, epoch=held.epoch, block_ids=list(held.block_table[first:first + count]),
                                        bytes_per_block=pool.bytes_per_block, timeout=self.timeout,
                                        lease_id=held.lease_id, grants=held.grant_messages())

    def write(self, held: Held, first: int, tokens: Seq[int], data: Any) -> int:
        """Writes ``data`` (whole blocks) into ``held``'s blocks from ``first`` on, then commits
        them (``tokens``: the sequence's tokens, at least to the last block's end) and lets
        the sequence go. Returns the blocks committed. On failure the sequence is let go
        uncommitted (the bytes may be partial: nobody reads them) and the error raised."""
        pool = self._pool(held.pool_id, held.epoch)
        bs = pool.block_size
        count = len(memoryview(data).cast("B")) // pool.bytes_per_block
        calls = self._stub()
        try:
            worker_store.write_blocks(pool.stub, epoch=held.epoch, lease_id=held.lease_id, generation=held.generation,
                                      block_ids=list(held.block_table[first:first + count]), data=data,
                                      timeout=self.timeout, grants=held.grant_messages())
            update = pb.SeqUpdate(sequence_id=held.sequence_id, num_tokens=held.num_tokens,
                                  parent_hash=held.last_hash, free=True,
                                  commits=[pb.BlockCommit(index=i, token_ids=tokens[i * bs:(i + 1) * bs])
                                           for i in range(first, first + count)])
            calls._call(calls.stub.Step, pb.StepRequest(lease_id=held.lease_id, request_id=new_request_id(),
                                                        updates=[update]))
        except Exception:
            try:
                self.release(held)
            except errors.KvsError as exc:
                _log.warning("kvservice store: releasing %s failed: %s", held.sequence_id, exc)
            raise
        return count

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        elif hasattr(self, "_calls"):
            self._calls.close()


class _Calls:
    """Allocator calls with no lease of their own (a connector's worker side, which acts on
    the scheduler side's lease): ``Client._call``'s retries and deadline."""

    def __init__(self, target: str, credentials: ClientCredentials, timeout: float) -> None:
        self.timeout = timeout
        self.retry_budget = 5.0
        self.rpc_count = 0
        self.channel = open_channel(target, self.retry_budget, credentials)
        self.stub = pb_grpc.AllocatorStub(self.channel)

    _call = Client._call
    pools = Client.pools

    def close(self) -> None:
        self.channel.close()
