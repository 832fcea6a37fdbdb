"""Authentication and roles on the allocator (docs/security.md): every RPC refuses callers
without credentials, with unknown tokens, of the wrong role or of another tenant, with
nothing changed in Redis; the allowed callers still work; the attacks of an open service
(lease theft through GetSequence, pool takeover, another tenant's cache salt) fail."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from helpers import TEST_SETTINGS, ServerThread, keyspace
from kvservice import errors
from kvservice.allocator.access import ROLES, SERVICE
from kvservice.client import Client
from kvservice.common.auth import TokenFile, add_token, parse_tokens, revoke_tokens
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

GEOMETRY = pb.PoolGeometry(num_blocks=256, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods]


@pytest.fixture
def secured(redis_url, tmp_path):
    """An allocator that authenticates every call; tokens of two tenants, a worker (pool
    "pool-a"), an admin; pool-a registered by its worker, pool-b by the admin."""
    path = str(tmp_path / "tokens")
    tokens = {name: add_token(path, name, role) for name, role in
              (("acme", "tenant"), ("globex", "tenant"), ("pool-a", "worker"), ("ops", "admin"))}
    with ServerThread(redis_url, TEST_SETTINGS, reap=False, tokens=TokenFile(path)) as server:
        channel = grpc.insecure_channel(server.target)
        stub = pb_grpc.AllocatorStub(channel)
        s = type("Secured", (), {})()
        s.server, s.stub, s.tokens, s.path, s.redis_url = server, stub, tokens, path, redis_url
        s.call = lambda method, request, who=None: getattr(stub, method)(
            request, timeout=10, metadata=_auth(tokens.get(who, who)) if who else None)
        s.epoch = s.call("RegisterPool", pb.RegisterPoolRequest(pool_id="pool-a", geometry=GEOMETRY),
                         "pool-a").epoch
        s.call("RegisterPool", pb.RegisterPoolRequest(pool_id="pool-b", geometry=GEOMETRY), "ops")
        s.lease = s.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=60), "acme").lease_id
        s.seq = s.call("CreateSequence", pb.CreateSequenceRequest(
            lease_id=s.lease, token_ids=list(range(10)), pool_id="pool-a"), "acme").sequence_id
        yield s
        channel.close()


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _requests(s) -> dict[str, object]:
    """A valid request of every method, as acme (or pool-a's worker) would send it."""
    lease, seq = s.lease, s.seq
    return {
        "RegisterPool": pb.RegisterPoolRequest(pool_id="pool-a", geometry=GEOMETRY),
        "ListPools": pb.ListPoolsRequest(),
        "DescribePool": pb.DescribePoolRequest(pool_id="pool-a"),
        "GetPoolStats": pb.GetPoolStatsRequest(pool_id="pool-a"),
        "Heartbeat": pb.HeartbeatRequest(pool_id="pool-a", epoch=s.epoch),
        "GrantLease": pb.GrantLeaseRequest(tenant="acme", ttl_seconds=30),
        "KeepAlive": pb.KeepAliveRequest(lease_id=lease),
        "RevokeLease": pb.RevokeLeaseRequest(lease_id=lease),
        "CreateSequence": pb.CreateSequenceRequest(lease_id=lease, token_ids=[1, 2, 3], pool_id="pool-a"),
        "Step": pb.StepRequest(lease_id=lease, updates=[pb.SeqUpdate(sequence_id=seq, num_tokens=10, grow_to=14)]),
        "ForkSequence": pb.ForkSequenceRequest(lease_id=lease, sequence_id=seq),
        "FreeSequences": pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[seq]),
        "GetSequence": pb.GetSequenceRequest(sequence_id=seq),
        "Sync": pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id="pool-a", epoch=s.epoch, want_blocks=4)]),
        "Audit": pb.AuditRequest(),
        "SettleTiers": pb.SettleTiersRequest(pool_id="pool-a", epoch=s.epoch, settled=[pb.TierSettlement(
            order=pb.TierOrder(pool_id="pool-a", epoch=s.epoch, src_tier=0, src=0, dst_tier=1, dst=0,
                               block_hash=b"h" * 16), ok=True)]),
    }


def _refused(s, method: str, request: object, who: str | None, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        s.call(method, request, who)
    assert info.value.code() == code, (method, who, info.value.code(), info.value.details())
    return info.value.details()


def test_the_role_table_names_every_allocator_method():
    assert sorted(m[len(SERVICE):] for m in ROLES) == sorted(METHODS)


@pytest.mark.parametrize("who", [None, "not-a-token", "kvs_forged"], ids=["no-credentials", "bad-token", "forged"])
def test_every_method_refuses_an_unauthenticated_caller_and_changes_nothing(secured, who):
    before = keyspace(secured.redis_url)
    for method, request in _requests(secured).items():
        _refused(secured, method, request, who, grpc.StatusCode.UNAUTHENTICATED)
    assert keyspace(secured.redis_url) == before


def test_every_method_refuses_a_role_it_is_not_open_to(secured):
    before = keyspace(secured.redis_url)
    checked = 0
    for method, request in _requests(secured).items():
        roles = ROLES[SERVICE + method]
        for who, role in (("acme", "tenant"), ("pool-a", "worker")):
            if role not in roles:
                details = _refused(secured, method, request, who, grpc.StatusCode.PERMISSION_DENIED)
                assert f"not open to the {role} role" in details
                checked += 1
    # 10 tenant methods refuse the worker, RegisterPool and Heartbeat the tenant, Audit both.
    assert checked == 14
    assert keyspace(secured.redis_url) == before


def test_another_tenant_cannot_use_a_lease_or_read_its_sequences(secured):
    before = keyspace(secured.redis_url)
    lease_calls = ["KeepAlive", "RevokeLease", "CreateSequence", "Step", "ForkSequence", "FreeSequences",
                   "GetSequence", "Sync", "GrantLease"]
    requests = _requests(secured)
    for method in lease_calls:
        details = _refused(secured, method, requests[method], "globex", grpc.StatusCode.PERMISSION_DENIED)
        assert secured.lease not in details, "an error must not repeat another tenant's lease id"
    assert keyspace(secured.redis_url) == before


def test_a_worker_may_register_and_heartbeat_only_its_own_pool(secured):
    before = keyspace(secured.redis_url)
    epoch_b = secured.call("DescribePool", pb.DescribePoolRequest(pool_id="pool-b"), "ops").epoch
    for method, request in (
            ("RegisterPool", pb.RegisterPoolRequest(pool_id="pool-b", geometry=GEOMETRY)),
            ("RegisterPool", pb.RegisterPoolRequest(geometry=GEOMETRY)),        # a new pool id
            ("Heartbeat", pb.HeartbeatRequest(pool_id="pool-b", epoch=epoch_b))):
        details = _refused(secured, method, request, "pool-a", grpc.StatusCode.PERMISSION_DENIED)
        assert "may only name its own pool" in details
    assert keyspace(secured.redis_url) == before
    # (a worker reads another pool's registration: where to pull that pool's blocks from)
    assert secured.call("DescribePool", pb.DescribePoolRequest(pool_id="pool-b"), "pool-a").epoch == epoch_b
    reply = secured.call("Heartbeat", pb.HeartbeatRequest(pool_id="pool-a", epoch=secured.epoch), "pool-a")
    assert reply.epoch == secured.epoch


def test_the_allowed_callers_still_work(secured):
    s = secured
    assert s.call("KeepAlive", pb.KeepAliveRequest(lease_id=s.lease), "acme").tenant == "acme"
    got = s.call("GetSequence", pb.GetSequenceRequest(sequence_id=s.seq), "acme")
    assert got.lease_id == s.lease and got.num_tokens == 10
    assert s.call("GetSequence", pb.GetSequenceRequest(sequence_id=s.seq), "ops").lease_id == s.lease
    assert s.call("Audit", pb.AuditRequest(), "ops").ok
    assert {p.pool_id for p in s.call("ListPools", pb.ListPoolsRequest(), "acme").pools} == {"pool-a", "pool-b"}
    # An admin may grant a lease for a tenant it names.
    assert s.call("GrantLease", pb.GrantLeaseRequest(tenant="globex", ttl_seconds=5), "ops").tenant == "globex"
    assert s.call("RevokeLease", pb.RevokeLeaseRequest(lease_id=s.lease), "acme").num_sequences_freed == 1


def test_sdk_client_takes_its_tenant_from_its_token(secured):
    s = secured
    with Client(s.server.target, token=s.tokens["globex"], local=True) as client:
        assert client.lease.tenant == "globex"
        seq = client.create(list(range(9)), pool="pool-a")
        client.step({seq: [1, 2, 3]})
        seq.free()
        client.flush()
    with pytest.raises(errors.PermissionDenied, match="may not grant a lease for tenant acme"):
        Client(s.server.target, token=s.tokens["globex"], tenant="acme")
    with pytest.raises(errors.Unauthenticated):
        Client(s.server.target)
    with pytest.raises(errors.Unauthenticated, match="unknown bearer token"):
        Client(s.server.target, token="kvs_wrong")


def test_lease_theft_through_get_sequence_fails(secured):
    """An open allocator answered GetSequence for anyone, with the owner's lease id; the
    ids are sequential, so every sequence could be found and its lease taken over."""
    s = secured
    pool, epoch, rest = s.seq.split("/")
    n, _, tag = rest.partition("-")
    assert len(tag) == 12
    for guess in range(1, int(n) + 5):
        for sid in (f"{pool}/{epoch}/{guess}", f"{pool}/{epoch}/{guess}-{tag}", f"{pool}/{epoch}/{guess}-{'0' * 12}"):
            with pytest.raises(grpc.RpcError) as info:
                s.call("GetSequence", pb.GetSequenceRequest(sequence_id=sid), "globex")
            assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)
            assert s.lease not in info.value.details()
    # The owner itself names its sequence by the whole id: without the tag, or with a
    # guessed one, it is not found (a guess tells nothing of which numbers are in use).
    assert s.call("GetSequence", pb.GetSequenceRequest(sequence_id=s.seq), "acme").lease_id == s.lease
    for sid in (f"{pool}/{epoch}/{n}", f"{pool}/{epoch}/{n}-{'0' * 12}", f"{pool}/{epoch}/{int(n) + 1}-{tag}"):
        with pytest.raises(grpc.RpcError) as info:
            s.call("GetSequence", pb.GetSequenceRequest(sequence_id=sid), "acme")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == f"sequence {sid} not found"
    # An admin may leave the tag out.
    assert s.call("GetSequence", pb.GetSequenceRequest(sequence_id=f"{pool}/{epoch}/{n}"), "ops").lease_id == s.lease
    # Even knowing the lease id, globex can do nothing with it.
    with pytest.raises(grpc.RpcError) as info:
        s.call("KeepAlive", pb.KeepAliveRequest(lease_id=s.lease), "globex")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_pool_takeover_fails(secured):
    """Re-registering a pool wipes it and may point its worker_address anywhere: only its
    own worker (or an admin) may."""
    s = secured
    before = keyspace(s.redis_url)
    for who in ("acme", "globex"):
        _refused(s, "RegisterPool", pb.RegisterPoolRequest(pool_id="pool-a", geometry=GEOMETRY,
                                                           worker_address="evil:1"), who,
                 grpc.StatusCode.PERMISSION_DENIED)
    assert keyspace(s.redis_url) == before
    assert s.call("DescribePool", pb.DescribePoolRequest(pool_id="pool-a"), "acme").worker_address != "evil:1"


def test_claiming_another_tenants_name_gets_neither_its_lease_nor_its_cache(secured):
    s = secured
    prompt = list(range(100, 140))
    with Client(s.server.target, token=s.tokens["acme"]) as acme:
        acme.create(prompt, pool="pool-a")            # cached under acme's salt
        with pytest.raises(errors.PermissionDenied):
            Client(s.server.target, token=s.tokens["globex"], tenant="acme")
        with Client(s.server.target, token=s.tokens["globex"]) as globex:
            assert globex.create(prompt, pool="pool-a").num_cached_tokens == 0
        with Client(s.server.target, token=s.tokens["acme"]) as acme2:
            assert acme2.create(prompt, pool="pool-a").num_cached_tokens == 36


def test_tokens_are_issued_and_revoked_without_a_restart(secured):
    s = secured
    token = add_token(s.path, "initech", "tenant")
    deadline = time.monotonic() + 5
    while True:
        try:
            lease = s.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=5), token)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "a new token was not taken within 5 s"
            time.sleep(0.2)
    assert lease.tenant == "initech"
    assert revoke_tokens(s.path, "initech") == 1
    deadline = time.monotonic() + 5
    while True:
        try:
            s.call("KeepAlive", pb.KeepAliveRequest(lease_id=lease.lease_id), token)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() < deadline, "a revoked token still worked after 5 s"
        time.sleep(0.2)


def test_a_broken_tokens_file_keeps_the_previous_tokens(secured):
    s = secured
    with open(s.path, "a") as f:
        f.write("this is not a token line\n")
    time.sleep(1.2)
    assert s.call("KeepAlive", pb.KeepAliveRequest(lease_id=s.lease), "acme").tenant == "acme"


@pytest.mark.parametrize("text, message", [
    ("sha256:abc acme tenant\n", "expected 'sha256:<64 hex digits> <name> <role>'"),
    ("sha256:" + "a" * 64 + " acme emperor\n", "unknown role 'emperor'"),
    ("sha256:" + "a" * 64 + " -acme tenant\n", "malformed identity name"),
    (("sha256:" + "a" * 64 + " acme tenant\n") * 2, "listed twice"),
])
def test_malformed_tokens_files_are_refused_with_the_line(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_tokens(text, "tokens")
    assert str(info.value).startswith("tokens:")


def test_the_tokens_file_holds_no_token_and_is_private(tmp_path):
    path = str(tmp_path / "tokens")
    token = add_token(path, "acme", "tenant")
    text = open(path).read()
    assert token not in text and text.startswith("sha256:")
    assert os.stat(path).st_mode & 0o077 == 0
    assert TokenFile(path).lookup(token).name == "acme"


def test_the_allocator_s_redis_user_may_run_every_command_the_allocator_sends():
    """The ACL of the embedded Redis's allocator user lists commands: every one the
    scripts call, and every one the store, the audit and the metrics send, is in it."""
    import re
    from pathlib import Path

    from kvservice.allocator.embedded import ALLOCATOR_COMMANDS

    root = Path(__file__).resolve().parent.parent / "kvservice" / "allocator"
    lua = " ".join(p.read_text() for p in (root / "scripts").rglob("*.lua"))
    used = {c.lower() for c in re.findall(r"(?:redis\.p?call|call_chunked)\('([A-Z]+)'", lua)}
    used |= {"hmget"} if "hmget_chunked" in lua else set()
    python = " ".join(p.read_text() for p in (root / n for n in ("store.py", "audit.py", "metrics.py", "core.py")))
    used |= set(re.findall(r"(?:pipe|redis|r)\.(h[a-z]+|z[a-z]+|l[a-z]+|s[a-z]+|get|set|ping|time|incr)\(", python))
    used -= {"pipeline", "set_response_callback"}
    assert used, "no command found: the scan is broken"
    assert used <= set(ALLOCATOR_COMMANDS), used - set(ALLOCATOR_COMMANDS)


def test_a_server_secret_salts_every_hash_and_a_group_shares_one_cache(redis_url, tmp_path):
    import hashlib
    import hmac

    from kvservice.common import hashing

    secret = tmp_path / "secret"
    secret.write_text("s3cr3t\n")
    settings = TEST_SETTINGS.replace(prefix_cache_secret_file=str(secret), prefix_cache_groups="labs=acme,globex")
    prompt = list(range(200, 241))
    with ServerThread(redis_url, settings) as server:
        with Client(server.target, tenant="acme", keepalive=False) as acme:
            acme.register_pool("pool-s", num_blocks=128, block_size=4)
            created = acme.stub.CreateSequence(pb.CreateSequenceRequest(lease_id=acme.lease_id, token_ids=prompt,
                                                                        pool_id="pool-s"), timeout=10)
            # The salt is the HMAC of the group's name under the secret, not a name anyone knows.
            salt = "hmac:" + hmac.new(b"s3cr3t", b"group:labs", hashlib.sha256).hexdigest()
            expected = hashing.chain_hashes(hashing.root_hash(salt), hashing.token_bytes_checked(prompt, "p"), 4, 10)
            assert list(created.block_hashes) == expected
            unsalted = hashing.chain_hashes(hashing.root_hash("acme"), hashing.token_bytes_checked(prompt, "p"), 4, 10)
            assert created.block_hashes[0] != unsalted[0]
            with Client(server.target, tenant="globex", keepalive=False) as globex:
                assert globex.create(prompt, pool="pool-s").num_cached_tokens == 40      # same group
            with Client(server.target, tenant="initech", keepalive=False) as initech:
                assert initech.create(prompt, pool="pool-s").num_cached_tokens == 0      # not in it


@pytest.mark.parametrize("groups, message", [
    ("labs", "is not group=tenant"), ("labs=", "is not group=tenant"), ("labs=a;ops=a", "is in groups labs and ops"),
    ("labs=a b", "malformed tenant"),
])
def test_malformed_cache_groups_are_refused(groups, message):
    from kvservice.allocator.config import Settings

    with pytest.raises(ValueError, match=message):
        Settings(prefix_cache_groups=groups)


def test_forks_beyond_one_call_are_made_in_bounded_calls_and_a_raw_step_is_bounded(redis_url):
    """One step's forks used to be bounded only per parent (256 children): 1,024 parents of
    1,024 tokens forking 256 each held Redis 16 s. Now a Step request carries at most
    max_forks_per_call children (a larger raw request: INVALID_ARGUMENT, nothing changed;
    the SDK sends a larger step in several), and forks that add more block references than
    one script call takes (max_fork_refs_per_call) are staged in parts of bounded work."""
    import grpc

    from kvservice.v1 import allocator_pb2 as pb

    s = TEST_SETTINGS
    with ServerThread(redis_url, s, reap=False) as server, Client(server.target, keepalive=False) as c:
        c.register_pool("forks", num_blocks=1 << 14, block_size=4)
        parents = [c.create(list(range(i * 400, (i + 1) * 400)), pool="forks") for i in range(3)]   # 100 blocks
        before = keyspace(redis_url)
        raw = pb.StepRequest(lease_id=c.lease_id, updates=[pb.SeqUpdate(sequence_id=p.id, num_tokens=-1,
                                                                        fork_grow_to=[401] * 100) for p in parents])
        with pytest.raises(grpc.RpcError) as info:
            c.stub.Step(raw, timeout=30)                                     # 300 children in one request
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {s.max_forks_per_call} per call" in info.value.details()
        assert keyspace(redis_url) == before
        kids = c.step(forks={p: [[1]] * 100 for p in parents}).children      # (the SDK: several Steps)
        assert [len(kids[p.id]) for p in parents] == [100] * 3
        refs = s.max_fork_refs_per_call // 100 + 1                           # past one call's references
        more = c.step(forks={parents[0]: [[1]] * refs}).children[parents[0].id]
        assert len(more) == refs and all(k.block_table[:100] == parents[0].block_table for k in more)
        assert c.audit().ok


def test_local_forks_beyond_one_call_s_bound_go_in_several_syncs(redis_url):
    with ServerThread(redis_url, TEST_SETTINGS) as server, Client(server.target, local=True) as c:
        c.register_pool("forks", num_blocks=1 << 15, block_size=4)
        parent = c.create(list(range(400)), pool="forks")                   # 100 blocks
        c.flush()
        batches = c.pool_stats("forks").journal_batches
        children = c.step(forks={parent: [[7]] * 200}).children[parent.id]  # 20,000 references
        c.flush()
        # (8,192 references per Sync at most: three batches at least)
        assert len(children) == 200 and c.pool_stats("forks").journal_batches - batches >= 3
        assert c.audit().ok
        assert c.pool_stats("forks").num_sequences == 201


def test_a_reap_frees_a_bounded_number_of_blocks_per_call():
    """A dead lease's sequences are freed over as many reap calls as their blocks take
    (max_blocks per call, one sequence at least), not in one call that holds Redis."""
    import asyncio

    from kvservice.allocator.embedded import EmbeddedRedis
    from kvservice.allocator.store import Store, connect

    # (a private Redis: any allocator's reaper would reap the dead lease too, in its own calls)
    with EmbeddedRedis() as private, ServerThread(private.url, TEST_SETTINGS, reap=False) as server, \
            Client(server.target, keepalive=False) as c:
        redis_url = private.url
        c.register_pool("reap", num_blocks=4096, block_size=4)
        for i in range(10):
            c.create(list(range(i * 400, (i + 1) * 400)), pool="reap")        # 100 blocks each

        async def reap_all() -> list[dict]:
            store = Store(connect(redis_url))
            try:
                await store.revoke_lease(c.lease_id)
                calls = []
                while True:
                    calls.append(await store.reap("reap", force_lease=c.lease_id, max_blocks=250))
                    if not calls[-1]["more"]:
                        return calls
            finally:
                await store.close()

        calls = asyncio.run(reap_all())
    # 250 blocks a call: two sequences of 100 blocks each, then the next one waits.
    assert [x["sequences"] for x in calls] == [2, 2, 2, 2, 2], calls
    assert calls[-1]["leases"] == 1
