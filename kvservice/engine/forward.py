"""The engine's forward path: the connections to the workers, one ``Forward`` per worker
per step (all in flight at once), the sampled tokens applied to their requests, and a
worker that fails a step (its requests recomputed elsewhere). A mixin of ``Engine``."""

from __future__ import annotations

import logging
import sys
import threading
import time
from array import array

import grpc

from kvservice import errors
from kvservice.client import StepResult
from kvservice.engine.requests import DECODE, DONE, FORK, LENGTH, PREFILL, STOP, Output, Request, _Branch, _Job
from kvservice.engine.scheduler import PREFILLED_KEPT
from kvservice.engine.text import Tokenizer
from kvservice.rpc import to_domain_error
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

log = logging.getLogger("kvservice.engine")

#: After a worker failed a step, the loop waits this long (seconds) before the next one.
LOST_WORKER_PAUSE_S = 0.1
#: How often the engine reads the pool list for pools being drained (seconds).
DRAIN_CHECK_S = 1.0
#: The channels to the workers: large tensors; a connection attempt to a worker that is
#: gone gives up after 2 s, not gRPC's default 20 s (a killed container's address drops
#: packets: its steps fail, and are recomputed elsewhere, that much sooner).
WORKER_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                          ("grpc.min_reconnect_backoff_ms", 2000), ("grpc.initial_reconnect_backoff_ms", 500),
                          ("grpc.max_reconnect_backoff_ms", 5000))


class ForwardPath:
    """The workers' side of a step (``Engine``'s)."""

    def refresh_workers(self) -> None:
        """Reads the pool list; connects to each pool's worker and checks they serve one model."""
        models = set()
        for p in self.client.pools():
            if p.role == "store":
                continue          # (a KV store's pool: external engines' connectors use it)
            self._num_blocks[p.pool_id] = p.geometry.num_blocks
            self._block_size[p.pool_id] = p.geometry.block_size
            self._roles[p.pool_id] = p.role or "both"
            if p.pool_id in self._stubs or not p.worker_address:
                continue
            channel = self.credentials.channel(p.worker_address, [*WORKER_CHANNEL_OPTIONS])
            stub = wpb_grpc.WorkerStub(channel)
            info = stub.Describe(wpb.DescribeWorkerRequest(include_tokenizer=self.model is None),
                                 timeout=self.timeout)
            if not info.HasField("model"):
                raise RuntimeError(f"worker {p.worker_address} of pool {p.pool_id} serves no model (--model)")
            models.add((info.model.name, info.model.seed))
            if self.model is None:
                if info.model.HasField("tokenizer"):
                    self.tokenizer = Tokenizer.from_info(info.model.tokenizer)
                self.model = wpb.ModelInfo()
                self.model.CopyFrom(info.model)
                self.model.ClearField("tokenizer")
            models.add((self.model.name, self.model.seed))   # a worker added later serves the same
            self._channels.append(channel)
            self._stubs[p.pool_id] = stub
        if not self._stubs or len(models) > 1:
            raise RuntimeError(f"need pools with workers that serve one model; found {sorted(models)}")

    def _move_sequences(self) -> None:
        """Sequences that leave their pool (DESIGN §13), at the start of a step, as the
        pool watcher last read the pool list (``_watch_pools``, a background thread: no
        call on the step's path):

        - a pool being drained (``kvservice drain``) takes nothing new from this engine; its
          reserve there goes back (``Client.leave_pool``), each decoding sequence there
          moves to another pool, and a request whose prompt is not computed yet is computed
          elsewhere; a pool that left the registry is forgotten;
        - disaggregated prefill / decode: a sequence that finished its prompt on a
          ``prefill`` pool moves to a ``decode`` (or ``both``) pool.

        A move is ``Sequence.migrate``: the copy's blocks are fetched before the next
        forward, so the request pauses for that step's fetch at most; one that no pool can
        take now is recomputed elsewhere."""
        if self._pool_watch is None:
            self._pool_watch = threading.Thread(target=self._watch_pools, name="kvs-pools", daemon=True)
            self._pool_watch.start()
        listed = self._listed_pools
        if listed is not None:
            for pool in [p for p in self._draining if p not in listed]:      # (drained: unregistered)
                self._stubs.pop(pool, None)
                self._num_blocks.pop(pool, None)
            draining = {pool for pool, p in listed.items() if p.draining and pool in self._stubs}
            for pool in draining - self._draining:
                log.info("pool %s is being drained: its sequences move to other pools", pool)
                try:
                    self.client.leave_pool(pool)
                except errors.KvsError as exc:      # (drained and unregistered meanwhile: nothing to give back)
                    log.warning("giving the reserve in pool %s back failed (%s: %s)", pool, type(exc).__name__, exc)
            self._draining = draining
        decoders = any(self._roles.get(p) != "prefill" for p in self._stubs if p not in self._draining)
        handoff = {p for p in self._stubs if self._roles.get(p) == "prefill"} if decoders else set()
        leaving = self._draining | handoff
        if not leaving:
            return
        for job in list(self._running):
            seqs = [b for b in job.branches if b.seq is not None and b.seq.pool in leaving]
            if not seqs:
                continue
            if any(b.state != DECODE for b in seqs):
                if any(b.seq.pool in self._draining for b in seqs):
                    self._requeue(job)          # (a prompt not computed yet: computed elsewhere)
                continue                        # (a prefill pool keeps it until its prompt is done)
            for b in seqs:
                old = b.seq
                try:
                    b.seq = self.client.migrate(old)
                except errors.KvsError as exc:
                    log.warning("sequence %s could not move off pool %s (%s: %s): recomputed elsewhere", old.id,
                                old.pool, type(exc).__name__, exc)
                    b.seq = old
                    self._requeue(job)
                    break
                self._live.pop(old.id, None)
                self._live[b.seq.id] = b.seq
                self.report.migrated_sequences += 1

    def _watch_pools(self) -> None:
        """Reads the pool list every ``DRAIN_CHECK_S`` for ``_move_sequences`` until the
        engine closes."""
        while not self._closing.wait(DRAIN_CHECK_S):
            try:
                pools, token = {}, ""
                while True:
                    reply = self.client.stub.ListPools(pb.ListPoolsRequest(page_size=1000, page_token=token),
                                                       timeout=self.timeout)
                    pools.update((p.pool_id, p) for p in reply.pools)
                    token = reply.next_page_token
                    if not token:
                        break
                self._listed_pools = pools
            except grpc.RpcError as exc:
                log.warning("reading the pool list failed (%s): drains are followed later", exc.code().name)

    def _forward(self, result: StepResult, before: dict) -> int:
        """Builds each pool's ForwardRequest, calls the workers in parallel, applies the
        sampled tokens; returns the number of sequences computed."""
        r = self.report
        self._move_blocks()         # (lower tiers: copies down and loads, before any write)
        if self._tainted:
            self._recompute_tainted()
        entries: dict[str, list[tuple[_Branch, _Job, wpb.ForwardSequence, str]]] = {}

        def add(pool: str, b: _Branch, job: _Job, fs: wpb.ForwardSequence, kind: str) -> None:
            entries.setdefault(pool, []).append((b, job, fs, kind))
        for job in self._running:
            for b in job.branches:
                s = b.seq
                if s is not None and s.lost:
                    continue           # (recomputed: _recompute_lost)
                sampling = _sampling(job.req, b.seed)
                if b.state == PREFILL:
                    bs, start = s.block_size, s.num_cached_tokens
                    if b.recompute_from >= 0:      # (a failed load: kvservice/engine/tiers.py)
                        start = min(start, b.recompute_from)
                    if self._unwritten.get(s.pool, set()).intersection(s.block_table[:start // bs]):
                        continue   # reads blocks that another prompt writes this step: wait one
                    # n > 1: the other samples' first tokens are drawn from the same position.
                    extra = ([_sampling(job.req, x.seed) for x in job.branches[1:]]
                             if job.forking and b.index == 0 else [])
                    add(s.pool, b, job, wpb.ForwardSequence(
                        token_ids=b.context[start:], start_position=start, block_table=s.block_table,
                        slot_mapping=s.slot_mapping(start), sampling=sampling, extra_samples=extra), PREFILL)
                elif b.state == DECODE and s.num_tokens == before.get(s, s.num_tokens - 1) + 1:
                    n = s.num_tokens
                    add(s.pool, b, job, wpb.ForwardSequence(
                        token_ids=[b.pending], start_position=n - 1, block_table=s.block_table,
                        slot_mapping=s.slot_mapping(n - 1), sampling=sampling), DECODE)
        copies: dict[str, list[wpb.BlockCopy]] = {}   # applied by the worker before the step's writes
        for c in result.copies:
            copies.setdefault(c.pool, []).append(wpb.BlockCopy(src=c.src, dst=c.dst))
        calls = {pool: self._executor.submit(self._forward_call, pool, items, copies.get(pool, []))
                 for pool, items in entries.items()}   # one Forward per worker, all in flight at once
        for pool in list(entries):
            try:
                response, entries[pool] = calls[pool].result()
            except (errors.Unavailable, errors.DeadlineExceeded, errors.FailedPrecondition) as exc:
                if isinstance(exc, errors.FailedPrecondition) and exc.reason != "EPOCH_CHANGED":
                    raise
                self._worker_lost(pool, exc)
                del entries[pool]
                continue
            items = entries[pool]
            rows = _rows(response.logits, len(items)) if self.return_logits and items else [None] * len(items)
            extra = iter(response.extra_tokens)
            for (b, job, fs, kind), token, row in zip(items, response.next_tokens, rows):
                # (the worker wrote these tokens' KV: their full blocks may be announced)
                b.seq.mark_written(fs.start_position + len(fs.token_ids))
                if kind == PREFILL:
                    r.prefill_tokens += len(fs.token_ids)
                    if len(b.context) > b.seq.block_size:
                        self._prefilled[tuple(b.context[:b.seq.block_size])] = None
                        if len(self._prefilled) > PREFILLED_KEPT:
                            self._prefilled.popitem(last=False)
                    written = fs.block_table[fs.start_position // b.seq.block_size:]
                    self._unwritten[pool].difference_update(written)
                    self._tainted.get((pool, b.seq.epoch), set()).difference_update(written)
                    if fs.extra_samples:   # n > 1: the others' first tokens; they fork next step
                        for x in job.branches[1:]:
                            self._sampled(x, job, next(extra), row, FORK)
                        job.forking = False
                self._sampled(b, job, token, row, DECODE)
        return sum(len(items) for items in entries.values())

    def _worker_lost(self, pool: str, exc: errors.KvsError) -> None:
        """A worker that cannot be reached, or that restarted since (its pool has a new
        epoch: its KV is gone), failed a step: the requests with sequences in its pool are
        recomputed from their tokens so far, as after a preemption, wherever placement puts
        them (a pool whose worker stopped heartbeating is placed last: docs/allocator.md).
        The other pools' results of the step are kept."""
        jobs = [j for j in self._running if any(b.seq is not None and b.seq.pool == pool for b in j.branches)]
        # (the prompts this step did not write have no hash: their blocks are committed
        # only once written, so freeing the sequences leaves nothing behind)
        log.warning("the worker of pool %s failed a step (%s: %s): %d request(s) recomputed elsewhere",
                    pool, type(exc).__name__, exc, len(jobs))
        self.report.worker_failures += 1
        self._lost_pools[pool] = time.monotonic()
        for job in jobs:
            self._requeue(job)
        self._unwritten.pop(pool, None)
        time.sleep(LOST_WORKER_PAUSE_S)   # (until placement sees the silence, the next create may land there again)

    def _forward_call(self, pool: str, items: list, copies: list[wpb.BlockCopy]) -> tuple[wpb.ForwardResponse, list]:
        """One worker's Forward, and the items it computed. A worker that refuses it for
        the pool's generation (the pool's state may have rolled back: RolledBack) is sent
        it again once the client has resynchronised there, without the sequences the
        resync lost (and their copy-on-write pairs)."""
        for attempt in range(2):
            epochs = {b.seq.epoch for b, _, _, _ in items}
            if len(epochs) > 1:
                raise RuntimeError(f"pool {pool}: sequences of several epochs {sorted(epochs)} in one step")
            epoch = epochs.pop() if epochs else 0
            request = wpb.ForwardRequest(epoch=epoch, copies=copies,
                                         sequences=[fs for _, _, fs, _ in items], return_logits=self.return_logits,
                                         lease_id=self.client.lease_id, generation=self.client.generation(pool))
            stub = self._stubs.get(pool)
            if stub is None:
                raise errors.Unavailable(f"no connection to the worker of pool {pool} (not reachable when the "
                                         f"pool list was read)")
            grants = self.client.take_grants(pool, epoch)
            request.grants.extend(grants)
            try:
                return stub.Forward(request, timeout=self.timeout), items
            except grpc.RpcError as exc:
                self.client.requeue_grants(grants)
                err = to_domain_error(exc)
                if attempt or not isinstance(err, errors.RolledBack):
                    raise err from None
            log.warning("pool %s refused a step for its generation (its Redis restarted or failed over): "
                        "resynchronising", pool)
            self.client.resync(pool)
            items = [x for x in items if not x[0].seq.lost]
            kept = {blk for x in items for blk in x[0].seq.block_table}
            copies = [c for c in copies if c.dst in kept]
            if not items:
                return wpb.ForwardResponse(), items
        raise AssertionError("unreachable")

    def _sampled(self, b: _Branch, job: _Job, token: int, row: array | None, state: str) -> None:
        """Records a branch's new token: it is fed next (``state``), or the branch is done
        (its ``max_new_tokens``, an end-of-sequence or stop token, a stop string)."""
        req = job.req
        b.outputs.append(token)
        b.pending = token
        if row is not None:
            b.logits.append(row)
        self.report.tokens += 1
        finish, text = "", ""
        if token in req.stop_token_ids or (not req.ignore_eos and self.tokenizer is not None
                                           and token in self.tokenizer.eos_token_ids):
            finish = STOP         # the token itself is no text
        elif b.detok is not None:
            text, stopped = b.stops.feed(b.detok.add(token))
            finish = STOP if stopped else ""
        if not finish and len(b.outputs) >= req.max_new_tokens:
            finish = LENGTH
        if finish and b.stops is not None:
            text += b.stops.flush()
        if job.handle is not None:
            job.handle._emit(Output(b.index, [token], text, finish or None))
        if finish:
            b.state, b.finish = DONE, finish
            if b.seq is not None:
                self._to_free.append(b.seq)
                b.seq = None
        else:
            b.state = state


def _sampling(req: Request, seed: int) -> wpb.SamplingParams:
    return wpb.SamplingParams(temperature=req.temperature, seed=seed, top_p=req.top_p, top_k=req.top_k)


def _rows(tensor: wpb.Tensor, count: int) -> list[array]:
    """Splits a float32 ``[count, vocab]`` tensor into rows."""
    if tensor.dtype != "float32" or len(tensor.shape) != 2 or tensor.shape[0] != count:
        raise RuntimeError(f"unexpected logits {tensor.dtype} {list(tensor.shape)} for {count} sequences")
    flat = array("f")
    flat.frombytes(tensor.data)
    if sys.byteorder == "big":  # the wire is little-endian
        flat.byteswap()
    vocab = tensor.shape[1]
    return [flat[i * vocab:(i + 1) * vocab] for i in range(count)]
