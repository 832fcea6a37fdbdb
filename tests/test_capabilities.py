"""The bytes obey the allocator: a worker touches a block only for a lease that the
allocator's grants give it to (docs/security.md, "Grants"). Real processes, mTLS on: an
allocator, two tiny-Llama workers with a host tier, and two tenants (``engine``, A, and
``api``, B), each with its own lease and the public SDK; B attacks A's blocks through
every data-plane RPC of the worker with its own valid credentials, a made-up lease, a
forged grant, A's own grant, another pool's and another epoch's; each is refused and A's
K/V is unchanged."""

from __future__ import annotations

import dataclasses
import time
import urllib.request

import grpc
import pytest
import torch

from kvservice import errors
from kvservice.client import Client
from kvservice.common.grants import Grant, new_key, pack_blocks
from kvservice.tools.launcher import Stack
from kvservice.v1 import allocator_pb2 as apb
from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker import tensors

pytestmark = pytest.mark.e2e

BS = 16
HEADS, DIM, LAYERS = 2, 64, 2      # (tiny-llama's K/V)


@pytest.fixture(scope="module")
def stack():
    with Stack(2, model="tiny-llama", block_size=BS, num_blocks=64, worker_args=("--host-tier-gb", "0.01")) as s:
        yield s


class Tenant:
    """One tenant's client (its lease) and worker stubs."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.client = Client(stack.target, credentials=stack.credentials(name))
        self.channels = [stack.credentials(name).channel(w.target) for w in stack.workers]
        self.stubs = {f"worker-{i}": pb_grpc.WorkerStub(ch) for i, ch in enumerate(self.channels)}
        self.epochs = {p: s.Describe(pb.DescribeWorkerRequest(), timeout=10).epoch for p, s in self.stubs.items()}

    @property
    def lease(self) -> str:
        return self.client.lease_id

    def grants(self, pool: str) -> list:
        return self.client.take_grants(pool, self.epochs[pool])

    def write(self, pool: str, slots: list[int], seed: int, **kw) -> pb.WriteKVResponse:
        g = torch.Generator().manual_seed(seed)
        k, v = torch.randn(len(slots), HEADS, DIM, generator=g), torch.randn(len(slots), HEADS, DIM, generator=g)
        fields = dict(epoch=self.epochs[pool], layer=0, slot_mapping=slots, key=tensors.encode(k),
                      value=tensors.encode(v), lease_id=self.lease, generation=self.client.generation(pool))
        fields.update(kw)
        if "grants" not in kw:
            fields["grants"] = self.grants(pool)
        return self.stubs[pool].WriteKV(pb.WriteKVRequest(**fields), timeout=10)

    def read(self, pool: str, slots: list[int]) -> bytes:
        r = self.stubs[pool].ReadKV(pb.ReadKVRequest(epoch=self.epochs[pool], layer=0, slots=slots,
                                                     lease_id=self.lease, grants=self.grants(pool)), timeout=10)
        return r.key.data + r.value.data

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.client.close()


def _slots(blocks) -> list[int]:
    return [b * BS + i for b in blocks for i in range(BS)]


def _refused(call, *codes) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() in (codes or (grpc.StatusCode.PERMISSION_DENIED,)), info.value.details()
    return info.value.details()


def test_another_tenant_touches_no_block_of_a_lease_through_any_worker_call(stack):
    a, b = Tenant(stack, "engine"), Tenant(stack, "api")
    try:
        sa = a.client.create(list(range(100, 100 + 3 * BS)), pool="worker-0")
        sa1 = a.client.create(list(range(900, 900 + 2 * BS)), pool="worker-1")
        a.write("worker-0", _slots(sa.block_table), seed=1)
        a.write("worker-1", _slots(sa1.block_table), seed=5)
        before = a.read("worker-0", _slots(sa.block_table))
        sb = b.client.create(list(range(500, 500 + 2 * BS)), pool="worker-0")
        sb1 = b.client.create(list(range(700, 700 + 2 * BS)), pool="worker-1")
        b.write("worker-0", _slots(sb.block_table), seed=2)       # (its own blocks: written)
        b.read("worker-1", _slots(sb1.block_table))
        ab, bb = list(sa.block_table), list(sb.block_table)
        w0, epoch = b.stubs["worker-0"], b.epochs["worker-0"]
        gen = b.client.generation("worker-0")
        q = tensors.encode(torch.randn(1, 4, DIM))
        attacks = {
            "WriteKV": lambda: b.write("worker-0", _slots(ab[:1]), seed=9),
            "ReadKV": lambda: b.read("worker-0", _slots(ab[:1])),
            "Attention": lambda: w0.Attention(pb.AttentionRequest(
                epoch=epoch, layer=0, query=q, block_tables=[pb.BlockTable(block_ids=ab)], context_lens=[3 * BS],
                query_lens=[1], lease_id=b.lease), timeout=10),
            "CopyBlocks (read)": lambda: w0.CopyBlocks(pb.CopyBlocksRequest(
                epoch=epoch, pairs=[pb.BlockCopy(src=ab[0], dst=bb[0])], lease_id=b.lease, generation=gen), timeout=10),
            "CopyBlocks (write)": lambda: w0.CopyBlocks(pb.CopyBlocksRequest(
                epoch=epoch, pairs=[pb.BlockCopy(src=bb[0], dst=ab[0])], lease_id=b.lease, generation=gen), timeout=10),
            "Forward": lambda: w0.Forward(pb.ForwardRequest(
                epoch=epoch, lease_id=b.lease, generation=gen, sequences=[pb.ForwardSequence(
                    token_ids=[1], start_position=3 * BS - 1, block_table=ab, slot_mapping=[ab[-1] * BS + BS - 1])]),
                timeout=10),
            "MoveBlocks (copy down)": lambda: w0.MoveBlocks(pb.MoveBlocksRequest(
                epoch=epoch, lease_id=b.lease, generation=gen,
                moves=[pb.BlockMove(src_tier=0, src=ab[0], dst_tier=1, dst=0, block_hash=b"h" * 16)]), timeout=10),
            "MoveBlocks (load)": lambda: w0.MoveBlocks(pb.MoveBlocksRequest(
                epoch=epoch, lease_id=b.lease, generation=gen,
                moves=[pb.BlockMove(src_tier=1, src=0, dst_tier=0, dst=ab[0], block_hash=b"h" * 16)]), timeout=10),
            "FetchBlocks": lambda: w0.FetchBlocks(pb.FetchBlocksRequest(
                epoch=epoch, lease_id=b.lease, generation=gen, source_pool_id="worker-1",
                source_epoch=b.epochs["worker-1"], fetches=[pb.BlockFetch(src=sb1.block_table[0], dst=ab[0])]),
                timeout=10),
            "WriteBlocks": lambda: w0.WriteBlocks(iter([pb.WriteBlocksRequest(
                epoch=epoch, lease_id=b.lease, generation=gen, block_ids=[ab[0]])]), timeout=10),
            "ReadBlocks": lambda: list(w0.ReadBlocks(pb.ReadBlocksRequest(
                epoch=epoch, lease_id=b.lease, block_ids=[ab[0]]), timeout=10)),
        }
        for name, attack in attacks.items():
            details = _refused(attack)
            if name.startswith("MoveBlocks"):       # (a move names its order before any block)
                assert "is not an order of the allocator" in details, (name, details)
            else:
                assert any(f"may not {right} block {x} " in details for x in ab for right in ("read", "write")), \
                    (name, details)
            assert "api" not in details and a.lease not in details, (name, details)   # (nothing of A's told)
        # A made-up lease, no lease at all, a forged grant, A's own grant, another pool's,
        # another epoch's: refused.
        _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9, lease_id="x"))
        _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9, lease_id=""), grpc.StatusCode.INVALID_ARGUMENT)
        forged = Grant("worker-0", epoch, gen, b.lease, "api", 1 << 40, pack_blocks(ab)).signed(new_key())
        assert "not signed" in _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9,
                                                        grants=[forged.to_pb(apb)]))
        stolen = Grant("worker-0", epoch, gen, a.lease, "engine", 1 << 40, pack_blocks(ab)).signed(new_key())
        assert "not signed" in _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9, lease_id=a.lease,
                                                        grants=[stolen.to_pb(apb)]))
        # (a real grant of A's, replayed by B: the tenant it names is not B)
        a2 = a.client.create(list(range(1500, 1500 + BS)), pool="worker-0")
        real = a.client.take_grants("worker-0", epoch)
        assert real and "only by the tenant" in _refused(lambda: b.write(
            "worker-0", _slots(a2.block_table), seed=9, lease_id=a.lease, grants=real))
        theirs = b.client.create(list(range(1700, 1700 + BS)), pool="worker-1")
        other_pool = b.client.take_grants("worker-1", b.epochs["worker-1"])
        assert "for pool 'worker-1'" in _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9,
                                                               grants=other_pool))
        old = dataclasses.replace(Grant.from_pb(other_pool[0]), pool_id="worker-0", epoch=epoch - 1)
        _refused(lambda: b.write("worker-0", _slots(ab[:1]), seed=9, grants=[old.to_pb(apb)]),
                 grpc.StatusCode.FAILED_PRECONDITION)
        # The confused deputy: B has worker-0 fetch A's blocks of worker-1 into B's own block
        # (its grant is good): worker-1 serves no block without the allocator's fetch order.
        b_own = b.read("worker-0", _slots(bb[:1]))
        deputy = w0.FetchBlocks(pb.FetchBlocksRequest(
            epoch=epoch, lease_id=b.lease, generation=gen, source_pool_id="worker-1", source_epoch=b.epochs["worker-1"],
            fetches=[pb.BlockFetch(src=s, dst=d) for s, d in zip(sa1.block_table, bb)]), timeout=10)
        assert not any(r.ok for r in deputy.results) and "fetch order" in deputy.results[0].error, deputy.results[0]
        assert b.read("worker-0", _slots(bb[:1])) == b_own
        # A worker's own credentials pull A's blocks directly: no order, nothing served (the
        # worker-0 identity naming itself as the destination, or naming none).
        ch = stack.credentials("worker-0").channel(stack.workers[1].target)
        try:
            for dst in ("worker-0", ""):
                details = _refused(lambda: list(pb_grpc.WorkerStub(ch).PullBlocks(pb.PullBlocksRequest(
                    pool_id="worker-1", epoch=b.epochs["worker-1"], dst_pool_id=dst,
                    blocks=[pb.BlockRef(index=x) for x in sa1.block_table]), timeout=10)))
                assert "fetch order" in details or "may not pull" in details, details
        finally:
            ch.close()
        text = urllib.request.urlopen(stack.workers[0].metrics_url, timeout=10).read().decode()
        counts = {line.split('result="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvservice_worker_grants_total{")}
        # (the two moves are refused for their orders, which the allocator never gave, the
        # other attacks denied for their blocks)
        moves = sum(1 for name in attacks if name.startswith("MoveBlocks"))
        assert counts["denied"] >= len(attacks) - moves + 1 and counts["refused"] >= 4 + moves, counts
        # A's K/V is what A wrote; A goes on writing and reading its own blocks.
        assert a.read("worker-0", _slots(sa.block_table)) == before
        a.write("worker-0", _slots(a2.block_table), seed=3, grants=real)
        for s in (sa, sa1, a2, sb, sb1, theirs):
            s.free()
    finally:
        a.close()
        b.close()


def test_a_block_given_to_another_tenant_is_zeroed_before_it_reads_it(stack):
    """A's blocks, freed (uncached: a prompt of one partial block), go to B's next create:
    B reads zeros, never A's K/V."""
    a, b = Tenant(stack, "engine"), Tenant(stack, "api")
    try:
        taken = []
        for i in range(64):       # (until B is given a block A wrote)
            sa = a.client.create(list(range(3000 + 20 * i, 3000 + 20 * i + BS - 1)), pool="worker-0")
            a.write("worker-0", _slots(sa.block_table)[:BS - 1], seed=7)
            block = sa.block_table[0]
            sa.free()
            sb = b.client.create(list(range(9000 + 20 * i, 9000 + 20 * i + BS - 1)), pool="worker-0")
            taken.append(sb)
            if sb.block_table[0] == block:
                got = b.read("worker-0", _slots([block]))
                assert got == bytes(len(got)), "B read K/V it never wrote"
                break
        else:
            pytest.fail("no block of A's went to B")
        for s in taken:
            s.free()
    finally:
        a.close()
        b.close()


def _byte_calls(t: Tenant, blocks: list[int], lease: str, grants: list, generation: int) -> dict:
    """Each worker method that reads or writes K/V, as ``t`` would call it on ``blocks`` of
    worker-0 with ``lease``, ``grants`` and ``generation`` (a call each)."""
    w0, epoch = t.stubs["worker-0"], t.epochs["worker-0"]
    g = torch.Generator().manual_seed(11)
    kv = [tensors.encode(torch.randn(BS, HEADS, DIM, generator=g)) for _ in range(2)]
    q = tensors.encode(torch.randn(1, 4, DIM, generator=g))
    fence = dict(epoch=epoch, lease_id=lease, grants=grants)
    return {
        "WriteKV": lambda: w0.WriteKV(pb.WriteKVRequest(layer=0, slot_mapping=_slots(blocks[:1]), key=kv[0],
                                                        value=kv[1], generation=generation, **fence), timeout=10),
        "ReadKV": lambda: w0.ReadKV(pb.ReadKVRequest(layer=0, slots=_slots(blocks[:1]), **fence), timeout=10),
        "Attention": lambda: w0.Attention(pb.AttentionRequest(
            layer=0, query=q, block_tables=[pb.BlockTable(block_ids=blocks)], context_lens=[len(blocks) * BS],
            query_lens=[1], **fence), timeout=10),
        "CopyBlocks": lambda: w0.CopyBlocks(pb.CopyBlocksRequest(
            pairs=[pb.BlockCopy(src=blocks[1], dst=blocks[0])], generation=generation, **fence), timeout=10),
        "Forward": lambda: w0.Forward(pb.ForwardRequest(generation=generation, sequences=[pb.ForwardSequence(
            token_ids=[1], start_position=len(blocks) * BS - 1, block_table=blocks,
            slot_mapping=[blocks[-1] * BS + BS - 1])], **fence), timeout=30),
        "MoveBlocks": lambda: w0.MoveBlocks(pb.MoveBlocksRequest(generation=generation, moves=[
            pb.BlockMove(src_tier=1, src=0, dst_tier=0, dst=blocks[0], block_hash=b"h" * 16)], **fence), timeout=10),
        "FetchBlocks": lambda: w0.FetchBlocks(pb.FetchBlocksRequest(
            generation=generation, source_pool_id="worker-1", source_epoch=t.epochs["worker-1"],
            fetches=[pb.BlockFetch(src=0, dst=blocks[0])], **fence), timeout=10),
        "WriteBlocks": lambda: w0.WriteBlocks(iter([pb.WriteBlocksRequest(
            generation=generation, block_ids=blocks[:1], **fence)]), timeout=10),
        "ReadBlocks": lambda: list(w0.ReadBlocks(pb.ReadBlocksRequest(block_ids=blocks[:1], **fence), timeout=10)),
    }


def test_every_rpc_refuses_a_made_up_lease_forged_stolen_foreign_replayed_grants_and_an_expired_lease(stack):
    """Each worker method that reads or writes K/V, called by tenant B on tenant A's blocks:
    with a made-up lease, a forged grant (B's own, rewritten to name A's blocks), A's own
    grant with A's lease (stolen), a grant of another pool, one of another epoch, B's grant of
    a block that was B's and is A's now (replayed), and on blocks of B's own lease once that
    lease has expired. Each call is refused, with a status that says so, and no byte of A's
    blocks changes. (A move names no order of the allocator here: MoveBlocks refuses it for
    that before it looks at any grant; tests/test_rights.py has forged, altered and replayed
    orders.)"""
    a, b = Tenant(stack, "engine"), Tenant(stack, "api")
    gone = Tenant(stack, "api")
    try:
        sa = a.client.create(list(range(4000, 4000 + 2 * BS)), pool="worker-0")
        a.write("worker-0", _slots(sa.block_table), seed=21)
        ab = list(sa.block_table)
        # B's block, written and freed (a partial block: not cached), until A's next create gets it.
        for i in range(64):
            sb = b.client.create(list(range(6000 + 20 * i, 6000 + 20 * i + BS - 1)), pool="worker-0")
            old = b.grants("worker-0")
            b.write("worker-0", _slots(sb.block_table)[:BS - 1], seed=22, grants=old)
            sb.free()
            mine = a.client.create(list(range(7000 + 20 * i, 7000 + 20 * i + BS - 1)), pool="worker-0")
            if mine.block_table[0] == sb.block_table[0]:
                a.write("worker-0", _slots(mine.block_table)[:BS - 1], seed=23)    # (A's newer grant: seen)
                break
            mine.free()
        else:
            pytest.fail("no block of B's went to A")
        replayed = list(mine.block_table) + ab[:1]
        stolen = a.grants("worker-0")
        assert stolen == []                       # (A sent its grants with its writes: take them again)
        a2 = a.client.create(list(range(8000, 8000 + BS - 1)), pool="worker-0")
        stolen = a.grants("worker-0")
        assert stolen
        sb1 = b.client.create(list(range(8500, 8500 + 2 * BS)), pool="worker-1")
        other_pool = b.grants("worker-1")
        own = b.client.create(list(range(9500, 9500 + 2 * BS)), pool="worker-0")
        mine_g = b.grants("worker-0")
        forged = [dataclasses.replace(Grant.from_pb(mine_g[0]), write=pack_blocks(ab), read=pack_blocks(ab)).to_pb(apb)]
        stale_epoch = [dataclasses.replace(Grant.from_pb(mine_g[0]), epoch=b.epochs["worker-0"] - 1).to_pb(apb)]
        # A lease of B's that expires (revoked) after it wrote its blocks.
        sg = gone.client.create(list(range(9900, 9900 + 2 * BS)), pool="worker-0")
        gone_grants = gone.grants("worker-0")
        gone.write("worker-0", _slots(sg.block_table), seed=24, grants=gone_grants)
        gone_lease, gone_blocks = gone.lease, list(sg.block_table)
        gone.client.close(revoke=True)
        before = a.read("worker-0", _slots(ab)) + a.read("worker-0", _slots(mine.block_table))
        cases = {
            "a made-up lease": (ab, "made-up-lease", []),
            "a forged grant": (ab, b.lease, forged),
            "a stolen grant": (list(a2.block_table) + ab[:1], a.lease, stolen),
            "a grant of another pool": (ab, b.lease, other_pool),
            "a grant of another epoch": (ab, b.lease, stale_epoch),
            "a replayed grant": (replayed, b.lease, old),
            "an expired lease": (gone_blocks, gone_lease, gone_grants),
        }
        deadline = time.monotonic() + 30        # (the worker hears of the revoked lease at its next heartbeat)
        while True:
            try:
                b.stubs["worker-0"].ReadKV(pb.ReadKVRequest(epoch=b.epochs["worker-0"], layer=0,
                                                            slots=_slots(gone_blocks[:1]), lease_id=gone_lease),
                                           timeout=10)
            except grpc.RpcError:
                break
            assert time.monotonic() < deadline, "the worker still serves a revoked lease's blocks"
            time.sleep(0.2)
        gen = b.client.generation("worker-0")
        assert gen
        refused = 0
        for case, (blocks, lease, grants) in cases.items():
            for rpc, call in _byte_calls(b, blocks, lease, list(grants), gen).items():
                details = _refused(call, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
                assert details and (a.lease not in details or case == "a stolen grant"), (case, rpc, details)
                refused += 1
        print(f"{refused} calls refused ({len(cases)} cases x 9 methods)")
        assert refused == len(cases) * 9
        assert a.read("worker-0", _slots(ab)) + a.read("worker-0", _slots(mine.block_table)) == before
        assert stack.audit().ok
        for s_ in (sa, mine, a2, own):
            s_.free()
        sb1.free()
    finally:
        a.close()
        b.close()


def test_another_tenant_settles_forgets_and_drops_nothing_of_a_lease_s_cached_prefix(stack):
    """SettleTiers takes the allocator's orders back, and the sequences of the caller's own
    lease: B's made-up orders (a forget of each of A's cached blocks, the settlement of a
    copy that never was) and A's sequence named as B's unwritten one are refused, and A's
    prefix stays cached."""
    a, b = Tenant(stack, "engine"), Tenant(stack, "api")
    try:
        prompt = list(range(3000, 3000 + 3 * BS + 1))
        first = a.client.create(prompt, pool="worker-0")
        table, epoch = list(first.block_table[:3]), first.epoch
        first.free()
        held = a.client.create(prompt, pool="worker-0")
        assert held.num_cached_tokens == 3 * BS
        made_up = [apb.TierOrder(pool_id="worker-0", epoch=epoch, src_tier=1, src=0, dst_tier=0, dst=x,
                                 block_hash=b"h" * 16, order_mac=b"m" * 16) for x in table]
        with pytest.raises(errors.PermissionDenied, match="forget.0. is not an order of the allocator"):
            b.client.settle_tiers("worker-0", epoch, [], [], made_up)
        copy = apb.TierOrder(pool_id="worker-0", epoch=epoch, src_tier=0, src=table[0], dst_tier=1, dst=0,
                             block_hash=b"h" * 16)
        with pytest.raises(errors.PermissionDenied, match="settled.0..order is not an order of the allocator"):
            b.client.settle_tiers("worker-0", epoch, [apb.TierSettlement(order=copy, ok=False)])
        with pytest.raises(errors.InvalidArgument, match="is not one of lease"):
            b.client.settle_tiers("worker-0", epoch, [], [], [], [(held.id, 0)])
        with pytest.raises(grpc.RpcError) as info:             # (naming A's lease as its own)
            b.client.stub.SettleTiers(apb.SettleTiersRequest(
                pool_id="worker-0", epoch=epoch, lease_id=a.lease,
                unwritten=[apb.UnwrittenBlocks(sequence_id=held.id, first_block=0)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
        # A's own lease drops nothing of the cached prefix its sequence shares (others wrote it).
        assert a.client.settle_tiers("worker-0", epoch, [], [], [], [(held.id, 0)]) == 0
        held.free()
        again = a.client.create(prompt, pool="worker-0")
        assert again.num_cached_tokens == 3 * BS and list(again.block_table[:3]) == table
        again.free()
        assert stack.audit().ok
    finally:
        a.close()
        b.close()


def test_another_tenant_overwriting_every_block_changes_no_answer_of_the_http_api(smollm2_cache):
    """The poisoning attempt from outside: the HTTP API (tenant ``api``, A) answers a greedy
    completion over SmolLM2; tenant ``engine`` (B), with its own valid credentials and lease,
    then tries to overwrite every block of the pool but its own through every RPC that
    writes K/V. Each call is refused, and A's answer to the same prompt, now from the prefix
    cache, still equals transformers' greedy generation."""
    import openai

    from chats import greedy
    from kvservice.engine import Engine
    from worker import weights

    name, steps, blocks = "smollm2-135m", 12, 48
    text = ("The old library on the hill keeps its atlases, maps and sea charts on the third floor, beside the "
            "reading room, where visitors may study them at the long oak tables every weekday until")
    with Stack(1, model=name, block_size=BS, num_blocks=blocks, http_port=0,
               worker_args=("--host-tier-gb", "0.01")) as stack, \
            openai.OpenAI(base_url=stack.api.url, api_key=stack.api_key, max_retries=0, timeout=120) as api, \
            Engine(stack.target, credentials=stack.credentials("engine")) as engine:
        tok = engine.tokenizer
        prompt = tok.encode(text)
        tokens, _ = greedy(weights.load(name), prompt, steps)
        assert not tok.eos_token_ids & set(tokens), "pick a question whose answer runs past the steps"
        expected = tok.decode(tokens)

        def ask():
            r = api.completions.create(model=name, prompt=prompt, max_tokens=steps, temperature=0)
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        first, _ = ask()
        assert first == expected
        b = Tenant(stack, "engine")
        try:
            own = b.client.create(list(range(7000, 7000 + BS)), pool="worker-0")
            b.stubs["worker-0"].ReadKV(pb.ReadKVRequest(epoch=b.epochs["worker-0"], layer=0, slots=[own.block_table[0] * BS],
                                                        lease_id=b.lease, grants=b.grants("worker-0")), timeout=10)
            w0, epoch, gen, mine = b.stubs["worker-0"], b.epochs["worker-0"], b.client.generation("worker-0"), own.block_table[0]
            targets = [x for x in range(blocks) if x != mine]
            g = torch.Generator().manual_seed(5)
            kv = [tensors.encode(torch.randn(BS, 3, 64, generator=g)) for _ in range(2)]
            refused = 0
            for x in targets:
                slots = _slots([x])
                for attack in (
                        lambda: w0.WriteKV(pb.WriteKVRequest(epoch=epoch, layer=0, slot_mapping=slots, key=kv[0],
                                                             value=kv[1], lease_id=b.lease, generation=gen), timeout=10),
                        lambda: w0.WriteBlocks(iter([pb.WriteBlocksRequest(
                            epoch=epoch, lease_id=b.lease, generation=gen, block_ids=[x])]), timeout=10)):
                    _refused(attack)
                    refused += 1
            whole = [
                lambda: w0.CopyBlocks(pb.CopyBlocksRequest(epoch=epoch, lease_id=b.lease, generation=gen,
                                                           pairs=[pb.BlockCopy(src=mine, dst=x) for x in targets]),
                                      timeout=10),
                lambda: w0.Forward(pb.ForwardRequest(epoch=epoch, lease_id=b.lease, generation=gen, sequences=[
                    pb.ForwardSequence(token_ids=[1] * len(targets), start_position=0, block_table=targets,
                                       slot_mapping=[x * BS for x in targets])]), timeout=30),
                lambda: w0.MoveBlocks(pb.MoveBlocksRequest(epoch=epoch, lease_id=b.lease, generation=gen, moves=[
                    pb.BlockMove(src_tier=1, src=i, dst_tier=0, dst=x, block_hash=b"h" * 16)
                    for i, x in enumerate(targets[:8])]), timeout=10),
                lambda: w0.FetchBlocks(pb.FetchBlocksRequest(
                    epoch=epoch, lease_id=b.lease, generation=gen, source_pool_id="worker-9", source_epoch=1,
                    fetches=[pb.BlockFetch(src=i, dst=x) for i, x in enumerate(targets)]), timeout=10)]
            for attack in whole:
                _refused(attack)
                refused += 1
            own.free()
        finally:
            b.close()
        again, cached = ask()
        print(f"{refused} writes of tenant engine refused; the API's answer again with {cached} cached prompt tokens")
        assert refused == 2 * len(targets) + len(whole)
        assert cached >= BS and again == expected
        assert stack.audit().ok
