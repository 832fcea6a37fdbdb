"""The Allocator gRPC servicer: translates proto <-> domain and nothing else."""

from __future__ import annotations

from typing import Any

from kvservice.allocator.access import TENANT, Access
from kvservice.allocator.audit import run_audit
from kvservice.allocator.core import Allocator
from kvservice.allocator.tiers import order_of
from kvservice.allocator.domain import (Create, JournalColumns, LeaseHoldings, LeaseInfo, Order, PoolInfo, ReserveGrant,
                                        ReserveRequest, SeqDelta, SeqState, SequenceClaim, StepOutcome, Update)
from kvservice.common.auth import caller
from kvservice.common.geometry import Geometry
from kvservice.common.settings import echo
from kvservice.errors import InvalidArgument
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

#: The pool's figures and counters (the tenant's own holdings and quotas are GetPoolStats').
STAT_FIELDS = [f.name for f in pb.PoolStats.DESCRIPTOR.fields if f.name not in ("pool_id", "epoch", "tiers")
               and not f.name.startswith(("tenant", "quota_"))]


def pool_to_pb(info: PoolInfo) -> pb.Pool:
    out = pb.Pool(pool_id=info.pool_id, epoch=info.epoch, worker_address=info.worker_address,
                  registered_at_ms=info.registered_at_ms, last_heartbeat_ms=info.last_heartbeat_ms,
                  geometry=info.geometry.to_pb(), generation=info.generation,
                  host_tier_blocks=info.host_tier_blocks, disk_tier_blocks=info.disk_tier_blocks,
                  draining=info.draining, role=info.role)
    if info.stats:
        out.stats.CopyFrom(stats_to_pb(info))
    return out


#: The figures of a pool that a tenant sees (the others sum every tenant's activity).
POOL_FIGURES = ("num_blocks", "num_free_blocks", "num_evictable_blocks", "num_used_blocks", "usage")


def stats_to_pb(info: PoolInfo) -> pb.PoolStats:
    values = {k: info.stats.get(k, 0) for k in STAT_FIELDS}
    values = {k: (float(v) if k == "usage" else int(v)) for k, v in values.items()}
    ident = caller()
    if ident is not None and ident.role == TENANT:
        values = {k: v for k, v in values.items() if k in POOL_FIGURES}
        return pb.PoolStats(pool_id=info.pool_id, epoch=info.epoch, **values)
    return pb.PoolStats(pool_id=info.pool_id, epoch=info.epoch, **values,
                        tiers=[pb.TierStats(**t) for t in info.stats.get("tiers", ())])


def lease_to_pb(lease: LeaseInfo) -> pb.Lease:
    return pb.Lease(lease_id=lease.lease_id, tenant=lease.tenant, ttl_seconds=lease.ttl_seconds,
                    deadline_ms=lease.deadline_ms)


def reserve_to_pb(g: ReserveGrant) -> pb.PoolReserve:
    return pb.PoolReserve(pool_id=g.pool_id, epoch=g.epoch, granted_blocks=g.granted_blocks,
                          num_reserved_blocks=g.num_reserved_blocks, reserve_cap=g.reserve_cap,
                          applied_entries=g.applied_entries, first_sequence_number=g.first_sequence_number,
                          num_sequence_numbers=g.num_sequence_numbers, lost_sequences=g.lost_sequences,
                          reserve_blocks=g.reserve_blocks, resynced=g.resynced, quota=g.quota,
                          quota_limit=g.quota_limit, generation=g.generation, rolled_back=g.rolled_back,
                          tier_orders=[tier_order_to_pb(o) for o in g.tier_orders],
                          grant=g.grant.to_pb(pb) if g.grant is not None else None)


def tier_order_to_pb(o: Order) -> pb.TierOrder:
    return pb.TierOrder(pool_id=o.pool_id, epoch=o.epoch, src_tier=o.src_tier, src=o.src, dst_tier=o.dst_tier,
                        dst=o.dst, block_hash=o.block_hash, source_pool_id=o.source_pool_id,
                        source_epoch=o.source_epoch, pin_id=o.pin_id, serial=o.serial, order_mac=o.order_mac)


def seq_to_pb(s: SeqState) -> pb.Sequence:
    out = pb.Sequence(sequence_id=s.sequence_id, pool_id=s.pool_id, epoch=s.epoch, lease_id=s.lease_id,
                      block_table=s.block_table, num_tokens=s.num_tokens,
                      num_cached_tokens=s.num_cached_tokens, num_committed_blocks=s.num_committed_blocks,
                      last_hash=s.last_hash, block_size=s.block_size, block_hashes=s.block_hashes)
    if s.cow is not None:
        out.cow.CopyFrom(pb.CopyPair(pool_id=s.pool_id, src=s.cow[0], dst=s.cow[1]))
    return out


def _fill_delta(out: pb.SeqDelta, d: SeqDelta) -> None:
    out.sequence_id = d.sequence_id
    out.num_tokens = d.num_tokens
    out.new_blocks.extend(d.new_blocks)
    out.num_committed_blocks = d.num_committed_blocks
    out.last_hash = d.last_hash
    if d.children:
        out.children.extend(seq_to_pb(c) for c in d.children)
    out.freed = d.freed
    if d.cow is not None:
        out.cow.pool_id = d.sequence_id.split("/", 1)[0]
        out.cow.src, out.cow.dst = d.cow


def outcome_to_pb(o: StepOutcome) -> pb.StepResponse:
    """A step's results; items of pools that failed are left empty (no sequence_id)."""
    out = pb.StepResponse()
    for d in o.updates:
        msg = out.updates.add()
        if d:
            _fill_delta(msg, d)
    for s in o.created:
        out.created.append(seq_to_pb(s) if s else pb.Sequence())
    out.copies.extend(pb.CopyPair(pool_id=p, src=a, dst=b) for p, a, b in o.copies)
    out.failed_pools.extend(o.failed_pools)
    out.generations.update(o.generations)
    out.tier_orders.extend(tier_order_to_pb(x) for x in o.tier_orders)
    out.grants.extend(g.to_pb(pb) for g in o.grants.values())
    return out


def create_from_pb(c: Any, tier_loads: bool = False, fetches: bool = False) -> Create:
    # The repeated field goes as it is: it is read once, into bytes, by the allocator.
    return Create(c.token_ids, c.pool_id, c.extra_key, tier_loads, fetches, c.defer_commits, c.pool_role)


class AllocatorServicer(pb_grpc.AllocatorServicer):
    def __init__(self, allocator: Allocator) -> None:
        self.a = allocator
        self.access = Access(allocator.store)

    async def RegisterPool(self, request: pb.RegisterPoolRequest, context: Any) -> pb.Pool:
        if not request.HasField("geometry"):
            raise InvalidArgument("geometry is required")
        Access.pool(request.pool_id, "RegisterPool")
        info = await self.a.register_pool(request.pool_id, Geometry.from_pb(request.geometry), request.worker_address,
                                          request.request_id, request.host_tier_blocks, request.disk_tier_blocks,
                                          request.disk_tier_kept, request.role)
        out = pool_to_pb(await self.a.describe_pool(info.pool_id))
        out.grant_key = info.grant_key          # (for the pool's worker: Access.pool checked the caller)
        return out

    async def ListPools(self, request: pb.ListPoolsRequest, context: Any) -> pb.ListPoolsResponse:
        pools, token = await self.a.list_pools_page(request.page_size, request.page_token)
        return pb.ListPoolsResponse(pools=[pool_to_pb(p) for p in pools], next_page_token=token)

    async def DescribePool(self, request: pb.DescribePoolRequest, context: Any) -> pb.Pool:
        # (any caller may read any pool's registration: a worker reads another pool's to
        # pull blocks from its worker, docs/security.md)
        return pool_to_pb(await self.a.describe_pool(request.pool_id))

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest, context: Any) -> pb.PoolStats:
        out = stats_to_pb(await self.a.describe_pool(request.pool_id))
        ident = caller()
        if ident is not None and ident.role == TENANT:
            blocks, sequences, leases = await self.a.store.tenant_holdings(request.pool_id, ident.name)
            q = self.a.quota(ident.name)
            out.tenant, out.tenant_blocks, out.tenant_sequences, out.tenant_leases = ident.name, blocks, sequences, leases
            out.quota_blocks, out.quota_sequences = q["blocks"], q["sequences"]
        return out

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        Access.pool(request.pool_id, "Heartbeat")
        beat = await self.a.heartbeat(request.pool_id, request.epoch, request.dead_since_ms)
        return pb.HeartbeatResponse(epoch=beat.epoch, heartbeat_at_ms=beat.heartbeat_ms, dead_leases=beat.dead_leases,
                                    dead_until_ms=beat.dead_until_ms, generation=beat.generation)

    async def GrantLease(self, request: pb.GrantLeaseRequest, context: Any) -> pb.Lease:
        tenant = Access.grant_tenant(request.tenant)
        return lease_to_pb(await self.a.grant_lease(tenant, request.ttl_seconds, request.request_id))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.Lease:
        await self.access.lease(request.lease_id)
        return lease_to_pb(await self.a.keep_alive(request.lease_id))

    async def RevokeLease(self, request: pb.RevokeLeaseRequest, context: Any) -> pb.RevokeLeaseResponse:
        await self.access.lease(request.lease_id)
        return pb.RevokeLeaseResponse(num_sequences_freed=await self.a.revoke_lease(request.lease_id))

    async def CreateSequence(self, request: pb.CreateSequenceRequest, context: Any) -> pb.Sequence:
        await self.access.lease(request.lease_id)
        create = Create(request.token_ids, request.pool_id, request.extra_key)
        out = await self.a.step(request.lease_id, [], [create], request.request_id)
        seq = seq_to_pb(out.created[0])
        seq.generation = out.generations.get(seq.pool_id, 0)
        if seq.pool_id in out.grants:
            seq.grant.CopyFrom(out.grants[seq.pool_id].to_pb(pb))
        return seq

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        await self.access.lease(request.lease_id)
        synced = None
        if request.HasField("sync"):    # the lease's pending journal first (local mode's creates)
            if request.sync.lease_id != request.lease_id:
                raise InvalidArgument("a step's sync must be of the step's own lease "
                                             f"({echo(request.sync.lease_id)} is not {echo(request.lease_id)})")
            if request.sync.request_id and request.sync.request_id == request.request_id:
                raise InvalidArgument("a step and its sync need request ids of their own")
            synced = await self._sync(request.sync)
        # SeqUpdate messages carry the fields of model.Update under the same names: they
        # go to the allocator as they are (no copy on the decode hot path).
        out = await self.a.step(request.lease_id, request.updates,
                                [create_from_pb(c, request.tier_loads, request.fetches) for c in request.creates], request.request_id,
                                request.generations)
        reply = outcome_to_pb(out)
        if synced is not None:
            reply.sync.CopyFrom(synced)
        return reply

    async def ForkSequence(self, request: pb.ForkSequenceRequest, context: Any) -> pb.Sequence:
        await self.access.lease(request.lease_id)
        update = Update(request.sequence_id, request.num_tokens or -1, fork_grow_to=(0,))
        out = await self.a.step(request.lease_id, [update], [], request.request_id)
        seq = seq_to_pb(out.updates[0].children[0])
        seq.generation = out.generations.get(seq.pool_id, 0)
        if seq.pool_id in out.grants:
            seq.grant.CopyFrom(out.grants[seq.pool_id].to_pb(pb))
        return seq

    async def FreeSequences(self, request: pb.FreeSequencesRequest, context: Any) -> pb.FreeSequencesResponse:
        if not request.sequence_ids:
            raise InvalidArgument("FreeSequences needs at least one sequence_id")
        await self.access.lease(request.lease_id)
        updates = [Update(s, free=True) for s in request.sequence_ids]
        out = await self.a.step(request.lease_id, updates, [], request.request_id)
        return pb.FreeSequencesResponse(num_sequences_freed=sum(1 for d in out.updates if d and d.freed))

    async def GetSequence(self, request: pb.GetSequenceRequest, context: Any) -> pb.Sequence:
        state = await self.a.get_sequence(request.sequence_id)
        await self.access.sequence(state.lease_id)
        return seq_to_pb(state)

    async def DrainPool(self, request: pb.DrainPoolRequest, context: Any) -> pb.Pool:
        return pool_to_pb(await self.a.drain_pool(request.pool_id, not request.undo))

    async def UnregisterPool(self, request: pb.UnregisterPoolRequest, context: Any) -> pb.UnregisterPoolResponse:
        got = await self.a.unregister_pool(request.pool_id, request.force)
        return pb.UnregisterPoolResponse(epoch=got["epoch"], num_sequences=got["sequences"],
                                         num_reserved_blocks=got["reserved"])

    async def MigrateSequence(self, request: pb.MigrateSequenceRequest, context: Any) -> pb.MigrateSequenceResponse:
        await self.access.lease(request.lease_id)
        made, orders, generation, grant = await self.a.migrate_sequence(request.lease_id, request.sequence_id,
                                                                        request.pool_id, request.block_hashes,
                                                                        request.request_id)
        seq = seq_to_pb(made)
        seq.generation = generation
        if grant is not None:
            seq.grant.CopyFrom(grant.to_pb(pb))
        return pb.MigrateSequenceResponse(sequence=seq, fetches=[tier_order_to_pb(o) for o in orders])

    async def Sync(self, request: pb.SyncRequest, context: Any) -> pb.SyncResponse:
        await self.access.lease(request.lease_id)
        return await self._sync(request)

    async def _sync(self, request: pb.SyncRequest) -> pb.SyncResponse:
        pools = [ReserveRequest(p.pool_id, p.epoch, p.want_blocks, tuple(p.returned_blocks), p.first_entry,
                                journal_from_pb(p.journal), p.want_sequence_numbers, p.need_blocks,
                                resync_from_pb(p.resync) if p.HasField("resync") else None, p.generation)
                 for p in request.pools]
        lease, grants = await self.a.sync(request.lease_id, pools, request.request_id)
        return pb.SyncResponse(lease=lease_to_pb(lease), pools=[reserve_to_pb(g) for g in grants])

    async def SettleTiers(self, request: pb.SettleTiersRequest, context: Any) -> pb.SettleTiersResponse:
        Access.pool(request.pool_id, "SettleTiers")
        if request.unwritten:
            await self.access.lease(request.lease_id)
        n, released, forgotten = await self.a.settle_tiers(
            request.pool_id, request.epoch, [(order_of(s.order), s.ok) for s in request.settled],
            list(request.release_pins), [order_of(o) for o in request.forget], request.lease_id,
            [(u.sequence_id, u.first_block) for u in request.unwritten])
        return pb.SettleTiersResponse(num_settled=n, num_released=released, num_forgotten=forgotten)

    async def Audit(self, request: pb.AuditRequest, context: Any) -> pb.AuditResponse:
        holdings: list[LeaseHoldings] = []
        problems, infos = await run_audit(self.a, request.pool_id, holdings=holdings)
        return pb.AuditResponse(ok=not problems, problems=problems, pools=[stats_to_pb(i) for i in infos],
                                leases=[pb.LeaseHoldings(pool_id=h.pool_id, lease_id=h.lease_id,
                                                         num_sequences=h.num_sequences,
                                                         num_reserved_blocks=h.num_reserved_blocks,
                                                         applied_entries=h.applied_entries,
                                                         num_staged_blocks=h.num_staged_blocks) for h in holdings])



def journal_from_pb(j: pb.JournalEntries) -> JournalColumns:
    return JournalColumns(list(j.kinds), list(j.sequences), list(j.num_tokens), list(j.children),
                          list(j.num_blocks), list(j.blocks), list(j.num_commits), list(j.commit_tokens),
                          j.parent_hashes)


def resync_from_pb(r: pb.PoolResync) -> tuple[SequenceClaim, ...]:
    return tuple(SequenceClaim(c.sequence, c.num_tokens, tuple(c.block_table), c.num_committed_blocks, c.last_hash,
                               c.block_hashes, c.num_cached_tokens) for c in r.sequences)
