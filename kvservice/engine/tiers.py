"""The engine's side of the lower tiers (DESIGN §12) and of fetches (§13): the
allocator's orders go to each pool's worker (``MoveBlocks``, then ``FetchBlocks`` for the
blocks another pool's worker holds) before the step's forward, the worker's word goes
back to the allocator (``SettleTiers``: entries settled, the sources' read pins
released), and a load or fetch that failed is recomputed. A mixin of ``Engine``.

Order of events in a step: the step's allocator call answers with orders (copies down of
the blocks it evicted, loads of the prefix hits in a lower tier), a background Sync may
have added more (copies down of blocks its refill evicted); ``_move_blocks`` sends them,
pool by pool and in order, before any forward writes a block. A copy down that succeeded
makes its entry usable once settled; a load that failed (its checksum or its hash did not
match) leaves the block unwritten: the sequences that counted it as cached compute it
again in this step's forward (``recompute_from``), the others that read it wait for that
(``_unwritten``), and its entry is dropped. Wrong KV is never served."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from kvservice import errors
from kvservice.engine.requests import PREFILL
from kvservice.rpc import to_domain_error
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb

log = logging.getLogger("kvservice.engine")


class TierPath:
    """Lower-tier orders (``Engine``'s)."""

    def _move_blocks(self) -> None:
        """Runs the orders answered since the last step on their workers (all pools at once),
        then the fetches from other pools' workers, and settles them with the allocator in
        the background."""
        orders = self.client.take_tier_orders()
        if not orders:
            return
        groups: dict[tuple[str, int], list[pb.TierOrder]] = {}
        fetches: dict[tuple[str, int, str, int], list[pb.TierOrder]] = {}
        for o in orders:
            if o.source_pool_id:
                fetches.setdefault((o.pool_id, o.epoch, o.source_pool_id, o.source_epoch), []).append(o)
            else:
                groups.setdefault((o.pool_id, o.epoch), []).append(o)
        self._run_moves(groups)
        if fetches:
            self._run_fetches(fetches)

    def _run_moves(self, groups: dict[tuple[str, int], list[pb.TierOrder]]) -> None:
        calls = {key: self._executor.submit(self._move_call, key, group) for key, group in groups.items()}
        r = self.report
        for (pool, epoch), group in groups.items():
            try:
                response = calls[(pool, epoch)].result()
            except (errors.Unavailable, errors.DeadlineExceeded, errors.FailedPrecondition) as exc:
                # (a worker gone or restarted: its entries were never confirmed, and its
                # sequences fail this step's forward and are recomputed; a worker that only
                # stalled past the deadline serves the forward: the blocks its loads were to
                # fill are recomputed by their readers)
                log.warning("pool %s: %d lower-tier orders not run (%s: %s)", pool, len(group),
                            type(exc).__name__, exc)
                self._taint(pool, epoch, [o for o in group if not o.dst_tier])
                continue
            settled, failed = [], []
            for o, res in zip(group, response.results):
                if o.dst_tier:
                    r.offloaded_blocks += res.ok
                    settled.append(pb.TierSettlement(order=o, ok=res.ok))
                elif res.ok:
                    r.loaded_blocks += 1
                else:
                    r.load_failures += 1
                    failed.append(o)
                    settled.append(pb.TierSettlement(order=o, ok=False))
                    log.warning("pool %s: load of %s entry %d into block %d failed (%s): recomputed", pool,
                                "host" if o.src_tier == 1 else "disk", o.src, o.dst, res.error)
            # (recomputed by their readers: _recompute_tainted, right after; their hashes
            # forgotten in the call that drops the entries they failed to load)
            self._taint(pool, epoch, failed, forget=False)
            if settled:
                self._executor.submit(self._settle, pool, epoch, settled, (), failed)

    def _run_fetches(self, groups: dict[tuple[str, int, str, int], list[pb.TierOrder]]) -> None:
        """Fetches (DESIGN §13): each destination pool's worker pulls its blocks from the
        source pool's worker (``FetchBlocks``). A block that did not arrive (its source
        gone, a checksum, a pin lost: src -1) is recomputed by its readers, as a failed
        load; the source's pins are released once their fetches ran."""
        def readable(key: tuple[str, int, str, int], o: pb.TierOrder) -> bool:
            # (a device block of the source that this engine knows unwritten: a prompt not
            # computed yet, or tainted, its hash not forgotten yet; fetched, it would be
            # wrong KV)
            _, _, source, source_epoch = key
            return o.src >= 0 and (o.src_tier or (o.src not in self._unwritten.get(source, ()) and
                                                  o.src not in self._tainted.get((source, source_epoch), ())))
        runnable = {key: [o for o in group if readable(key, o)] for key, group in groups.items()}
        unreadable = {key: [o for o in group if not readable(key, o)] for key, group in groups.items()}
        calls = {key: self._executor.submit(self._fetch_call, key, group)
                 for key, group in runnable.items() if group}
        r = self.report
        release: dict[tuple[str, int], set[str]] = {}
        for key, group in groups.items():
            pool, epoch, source, source_epoch = key
            failed = list(unreadable[key])
            response = None
            if key in calls:
                try:
                    response = calls[key].result()
                except (errors.Unavailable, errors.DeadlineExceeded, errors.FailedPrecondition) as exc:
                    # (this pool's worker gone or restarted: its sequences fail this step's
                    # forward and are recomputed; one that only stalled past the deadline
                    # serves the forward: the blocks are recomputed by their readers)
                    log.warning("pool %s: %d fetches from pool %s not run (%s: %s)", pool, len(runnable[key]),
                                source, type(exc).__name__, exc)
                    response = None
                    r.fetch_failures += len(runnable[key])
                    self._taint(pool, epoch, runnable[key])
                if response is not None:
                    errors_seen = [res.error for res in response.results if not res.ok]
                    failed.extend(o for o, res in zip(runnable[key], response.results) if not res.ok)
                    if errors_seen:
                        log.warning("pool %s: %d of %d blocks fetched from pool %s failed (first: %s): recomputed",
                                    pool, len(errors_seen), len(runnable[key]), source, errors_seen[0])
            if response is not None or key not in calls:
                r.fetched_blocks += len(group) - len(failed)
            r.fetch_failures += len(failed)
            self._taint(pool, epoch, failed)   # (recomputed by their readers: _recompute_tainted, right after)
            release.setdefault((source, source_epoch), set()).update(o.pin_id for o in group if o.pin_id)
        for (source, source_epoch), pins in release.items():
            if pins:
                self._executor.submit(self._settle, source, source_epoch, [], sorted(pins))

    def _fetch_call(self, key: tuple[str, int, str, int], group: list[pb.TierOrder]) -> wpb.FetchBlocksResponse:
        pool, epoch, source, source_epoch = key
        stub = self._stubs.get(pool)
        if stub is None:
            raise errors.Unavailable(f"no connection to the worker of pool {pool}")
        request = wpb.FetchBlocksRequest(
            epoch=epoch, lease_id=self.client.lease_id, generation=self.client.generation(pool),
            source_pool_id=source, source_epoch=source_epoch,
            fetches=[wpb.BlockFetch(src_tier=o.src_tier, src=o.src, block_hash=o.block_hash, dst=o.dst,
                                     order_mac=o.order_mac, pull_serial=o.serial)
                     for o in group])
        return self._call(stub.FetchBlocks, request, pool, epoch)

    def _call(self, method: Any, request: Any, pool: str, epoch: int) -> Any:
        """A worker call with the client's grants for the pool (given back if it fails)."""
        grants = self.client.take_grants(pool, epoch)
        request.grants.extend(grants)
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            self.client.requeue_grants(grants)
            raise to_domain_error(exc) from None

    def _move_call(self, key: tuple[str, int], group: list[pb.TierOrder]) -> wpb.MoveBlocksResponse:
        pool, epoch = key
        stub = self._stubs.get(pool)
        if stub is None:
            raise errors.Unavailable(f"no connection to the worker of pool {pool}")
        request = wpb.MoveBlocksRequest(
            epoch=epoch, lease_id=self.client.lease_id, generation=self.client.generation(pool),
            moves=[wpb.BlockMove(src_tier=o.src_tier, src=o.src, dst_tier=o.dst_tier, dst=o.dst,
                                 block_hash=o.block_hash, order_mac=o.order_mac, serial=o.serial) for o in group])
        return self._call(stub.MoveBlocks, request, pool, epoch)

    def _taint(self, pool: str, epoch: int, orders: list[pb.TierOrder], forget: bool = True) -> None:
        """The device blocks that ``orders`` (loads or fetches into ``pool``) did not fill:
        their content is not what their hash says. This engine's readers of them recompute
        them (``_recompute_tainted``), and the allocator forgets their hashes (in the
        background, on those orders; ``forget`` False: the caller has them forgotten), so
        that no other create, copy down or fetch reads them."""
        if orders:
            self._tainted.setdefault((pool, epoch), set()).update(o.dst for o in orders)
            if forget:
                self._executor.submit(self._settle, pool, epoch, [], (), list(orders))

    def _settle(self, pool: str, epoch: int, settled: list[pb.TierSettlement], release_pins: list[str] = (),
                forget: list[pb.TierOrder] = ()) -> None:
        """Passes the worker's word on to the allocator, releases the read pins of the
        fetches that ran, and has the hashes of the blocks that the orders of ``forget``
        did not fill dropped (a failure only delays an entry's use: unconfirmed, it is
        taken back after a minute; a pin is released at its deadline; a block not
        forgotten stays known to this engine as tainted)."""
        try:
            self.client.settle_tiers(pool, epoch, settled, list(release_pins), list(forget))
        except errors.KvsError as exc:
            log.warning("pool %s: %d lower-tier entries not settled, %d pins not released, %d hashes not dropped "
                        "(%s: %s)", pool, len(settled), len(release_pins), len(forget), type(exc).__name__, exc)

    def _recompute_tainted(self) -> None:
        """Each step: the tainted blocks of each pool's current epoch are recomputed by
        the sequences that count them as cached (an older epoch's are forgotten: its pool
        started anew)."""
        newest: dict[str, int] = {}
        for s in self._live.values():
            newest[s.pool] = max(newest.get(s.pool, 0), s.epoch)
        for (pool, epoch) in list(self._tainted):
            blocks = self._tainted[(pool, epoch)]
            if not blocks or newest.get(pool, epoch) > epoch:
                del self._tainted[(pool, epoch)]
            else:
                self._recompute_blocks(pool, blocks, epoch)

    def _recompute_blocks(self, pool: str, blocks: set[int], epoch: int = 0) -> None:
        """Blocks whose content is not what their hash says (a failed load; a prompt a
        failed step never wrote: ``_tainted``): each sequence (of ``epoch``, 0: any) whose
        cached prefix holds one computes its prompt again from that block on; the other
        readers wait until it is written."""
        self._unwritten.setdefault(pool, set()).update(blocks)
        for job in self._running:
            for b in job.branches:
                s = b.seq
                if s is None or s.pool != pool or b.state != PREFILL or (epoch and s.epoch != epoch):
                    continue
                bs = s.block_size
                start = min(b.recompute_from, s.num_cached_tokens) if b.recompute_from >= 0 else s.num_cached_tokens
                bad = [i for i, blk in enumerate(s.block_table[:start // bs]) if blk in blocks]
                if bad:
                    b.recompute_from = bad[0] * bs
                    self.report.prefix_hit_tokens -= start - b.recompute_from
                    if b.index == 0 and job.cached > b.recompute_from:
                        job.cached = b.recompute_from
