"""Test helpers: servers in a thread (``LoopThread``), audits and state snapshots."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import types
from typing import Any

from kvservice.allocator.core import Allocator
from kvservice.allocator.config import Settings
from kvservice.allocator.server import create_server, reaper
from kvservice.allocator.audit import run_audit
from kvservice.allocator.store import Store, connect, is_cluster
from kvservice.common.auth import TokenFile, add_token
from kvservice.common.security import ClientCredentials, ServerTls
from kvservice.tools.certs import make_certs
from kvservice.v1 import allocator_pb2 as pb

TEST_SETTINGS = Settings(reap_interval=0.05, request_ttl=60.0)

_SUITE: types.SimpleNamespace | None = None
#: host:port of each in-process allocator that takes TLS and tokens -> the credentials its
#: test clients present (conftest gives them to every ``Client`` and engine of the test
#: process that connects there without credentials of its own).
SECURE_TARGETS: dict[str, ClientCredentials] = {}


def examples(n: int, redis_url: str = "", fast: bool = True) -> int:
    """How many examples a property test runs: ``n``; a third of them over a Redis Cluster
    (the same scripts and rules as over one server, each call routed by the cluster client:
    the rules' coverage is checked there, their combinations over one server); a quarter
    with ``HYPOTHESIS_PROFILE=fast`` (``make test-fast``), unless ``fast`` is False (a test
    that checks which transitions its examples reached needs all of them)."""
    if redis_url and is_cluster(redis_url):
        n = max(5, n // 3)
    if fast and os.environ.get("HYPOTHESIS_PROFILE") == "fast":
        n = max(3, n // 4)
    return n


def suite_credentials() -> types.SimpleNamespace:
    """The suite's credentials, made once per process: a development CA and a server
    certificate (``kvservice certs``), and a tokens file with one admin's token (an admin
    may name any tenant, so tests choose their tenants as before)."""
    global _SUITE
    if _SUITE is None:
        d = tempfile.mkdtemp(prefix="kvs-suite-credentials-")
        atexit.register(shutil.rmtree, d, True)
        make_certs(d)
        tokens = os.path.join(d, "tokens")
        token = add_token(tokens, "suite", "admin")
        ca = os.path.join(d, "ca.pem")
        _SUITE = types.SimpleNamespace(dir=d, tokens=tokens, token=token, ca=ca,
                                       tls=ServerTls(os.path.join(d, "server.pem"), os.path.join(d, "server-key.pem")),
                                       # (localhost: a name of the certificate whatever the address,
                                       # and several replicas' addresses are no name at all)
                                       client=ClientCredentials(token=token, ca=ca, server_name="localhost"))
    return _SUITE


def server_args() -> tuple[str, ...]:
    """The ``kvservice serve`` flags of an allocator process with the suite's credentials."""
    c = suite_credentials()
    return ("--tls-cert", c.tls.cert, "--tls-key", c.tls.key, "--tokens-file", c.tokens)


def client_env() -> dict[str, str]:
    """The environment of a client process (a test's script, a worker) that presents the
    suite's credentials."""
    c = suite_credentials()
    return {"KVSERVICE_TLS_CA": c.ca, "KVSERVICE_TOKEN": c.token, "KVSERVICE_TLS_SERVER_NAME": "localhost"}


def credentials_for(target: str) -> ClientCredentials:
    """What a test client presents to ``target`` (one ``host:port`` or several, comma-separated)."""
    for t in target.split(","):
        if t.strip() in SECURE_TARGETS:
            return SECURE_TARGETS[t.strip()]
    return ClientCredentials()


class LoopThread:
    """Runs ``serve()`` (a coroutine that starts a server and sets ``port``) in its own
    thread and event loop; ``stop()`` ends it and waits for ``shutdown()``."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        await self.serve()
        self._ready.set()
        await self._stop.wait()
        await self.shutdown()

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self):
        self._thread.start()
        self._ready.wait(30)
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerThread(LoopThread):
    """A real grpc.aio allocator server on 127.0.0.1:0, in its own thread and event loop.

    By default it takes TLS only and authenticates every call against the suite's tokens
    file (``suite_credentials``); a test that gives its own ``tokens`` or ``tls`` gets
    exactly those, and ``secure=False`` a plaintext server that authenticates nobody."""

    def __init__(self, redis_url: str, settings: Settings = TEST_SETTINGS, *, reap: bool = True,
                 interceptors: tuple = (), tokens: Any = None, tls: Any = None, secure: bool | None = None) -> None:
        super().__init__()
        self.redis_url = redis_url
        self.settings = settings
        self.reap = reap
        self.interceptors = tuple(interceptors)   # (outside the error interceptor)
        self.secure = (tokens is None and tls is None) if secure is None else secure
        if self.secure:
            tokens, tls = TokenFile(suite_credentials().tokens), suite_credentials().tls
        self.tokens = tokens                      # a TokenFile: every call authenticated
        self.tls = tls                            # a ServerTls: the port takes TLS only

    def channel(self) -> Any:
        """A blocking channel to this server with the suite's credentials (if it takes them)."""
        return credentials_for(self.target).channel(self.target)

    async def serve(self) -> None:
        self.store = Store(connect(self.redis_url), wait_replicas=self.settings.redis_wait_replicas,
                           wait_timeout_ms=self.settings.redis_wait_timeout_ms)
        self.allocator = Allocator(self.store, self.settings)
        self.server, self.port = await create_server(self.allocator, "127.0.0.1:0", outer=self.interceptors,
                                                     tokens=self.tokens, tls=self.tls)
        await self.server.start()
        if self.secure:
            SECURE_TARGETS[f"127.0.0.1:{self.port}"] = suite_credentials().client
        self._sweeper = asyncio.create_task(reaper(self.allocator, self.settings.reap_interval)) if self.reap else None

    async def shutdown(self) -> None:
        SECURE_TARGETS.pop(f"127.0.0.1:{self.port}", None)
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper        # (ended before its loop closes)
        await self.server.stop(grace=0.5)
        await self.store.close()


def run_async(coro_fn, redis_url: str) -> Any:
    """Runs ``coro_fn(allocator)`` on a fresh connection, in a fresh event loop."""
    async def main() -> Any:
        store = Store(connect(redis_url))
        try:
            return await coro_fn(Allocator(store))
        finally:
            await store.close()
    return asyncio.run(main())


class StateReader:
    """The reads a test repeats many times on one Redis (pool snapshots, audits, stats), over
    one connection on a loop thread of its own, where ``snapshot``, ``audit`` and ``stats``
    open a fresh connection (and a cluster client its slot map) for each read."""

    def __init__(self, redis_url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._store = self._call(self._open(redis_url))
        self._allocator = Allocator(self._store)

    @staticmethod
    async def _open(redis_url: str) -> Store:
        return Store(connect(redis_url))

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def snapshot(self, pool_id: str) -> dict[str, Any]:
        return self._call(_snapshot(self._allocator, pool_id))

    def audit(self, pool_id: str = "") -> list[str]:
        return self._call(run_audit(self._allocator, pool_id))[0]

    def stats(self, pool_id: str) -> dict[str, Any]:
        return self._call(self._allocator.describe_pool(pool_id)).stats

    def close(self) -> None:
        self._call(self._store.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "StateReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _snapshot(a: Allocator, pool_id: str) -> dict[str, Any]:
    snap = await a.store.snapshot(pool_id)
    assert snap is not None, f"pool {pool_id} is not registered"
    snap.pop("stats")
    snap.pop("counts")
    snap.pop("version")     # (raised by every script that changes the pool, or might)
    return snap


def audit(redis_url: str, pool_id: str = "") -> list[str]:
    """The audit's problems on the live Redis (empty when clean)."""
    async def go(a: Allocator) -> list[str]:
        problems, _ = await run_audit(a, pool_id)
        return problems
    return run_async(go, redis_url)


def snapshot(redis_url: str, pool_id: str) -> dict[str, Any]:
    """The pool's allocation state (counters left out), for before/after comparisons."""
    return run_async(lambda a: _snapshot(a, pool_id), redis_url)


def stats(redis_url: str, pool_id: str) -> dict[str, Any]:
    async def go(a: Allocator) -> dict[str, Any]:
        return (await a.describe_pool(pool_id)).stats
    return run_async(go, redis_url)


def entry(kind: int, sequence: int, num_tokens: int, *, blocks=(), child: int = 0, commits=(),
          parent_hash: bytes = b"") -> dict[str, Any]:
    """One journal entry (``commits``: the token ids of each committed block)."""
    return {"kind": kind, "sequence": sequence, "num_tokens": num_tokens, "blocks": list(blocks), "child": child,
            "commits": [list(c) for c in commits], "parent_hash": parent_hash}


def journal_entries(entries) -> pb.JournalEntries:
    """Entries made with ``entry`` in the columns a Sync sends them in."""
    j = pb.JournalEntries()
    for e in entries:
        j.kinds.append(e["kind"])
        j.sequences.append(e["sequence"])
        j.num_tokens.append(e["num_tokens"])
        j.children.append(e["child"])
        j.num_blocks.append(len(e["blocks"]))
        j.blocks.extend(e["blocks"])
        j.num_commits.append(len(e["commits"]))
        for c in e["commits"]:
            j.commit_tokens.extend(c)
        if e["commits"]:
            j.parent_hashes += e["parent_hash"]
    return j


def sdk_call(client, handles: dict, pool: str, how: str, appends: dict, forks: dict, frees: list,
             creates: list) -> tuple[Any, Any, Any]:
    """One change through the SDK entry point a caller would use: ``Client.create``,
    ``Sequence.append`` / ``fork`` / ``free`` for ``how`` in create / append / fork / free
    (one change each), else one ``Client.step``; ``handles``: sequence id -> Sequence,
    ``creates``: (family, tokens) pairs. Returns (the StepResult of an append or a step, the
    created sequence, the forked child), None where there is none."""
    result = made = child = None
    if how == "create":
        made = client.create(creates[0][1], pool=pool)
    elif how == "append":
        (sid, tokens), = appends.items()
        result = handles[sid].append(tokens)
    elif how == "fork":
        (sid, kids), = forks.items()
        child = handles[sid].fork(kids[0])
    elif how == "free":
        handles[frees[0]].free()
    else:
        result = client.step({handles[s]: t for s, t in appends.items()},
                             forks={handles[s]: k for s, k in forks.items()},
                             frees=[handles[s] for s in frees],
                             creates=[(t, pool, b"") for _, t in creates])
    return result, made, child


def sync_redis(url: str):
    """A blocking client of the Redis (or Redis Cluster: a cluster client) at ``url``."""
    import redis
    from redis.cluster import RedisCluster

    return RedisCluster.from_url(url) if is_cluster(url) else redis.Redis.from_url(url)


def all_keys(r) -> list[bytes]:
    from redis.cluster import RedisCluster

    if isinstance(r, RedisCluster):
        return sorted(k for node in r.get_primaries() for k in r.keys("*", target_nodes=node))
    return sorted(r.keys("*"))


def flush(url: str) -> None:
    """Empties the Redis at ``url`` (every primary of a cluster)."""
    from redis.cluster import RedisCluster

    with sync_redis(url) as r:
        if isinstance(r, RedisCluster):
            r.flushall(target_nodes=RedisCluster.PRIMARIES)
        else:
            r.flushall()


def keyspace(url: str) -> dict[bytes, bytes]:
    """Every key of a Redis (or of every shard of a cluster) and its DUMP: compared before
    and after a refused call, it shows that nothing changed."""
    with sync_redis(url) as r:
        return {k: r.dump(k) for k in all_keys(r)}


def used_blocks(stack) -> int:
    """Blocks in block tables over a ``Stack``'s pools, as the allocator counts them
    (asked as the stack's admin)."""
    from kvservice.client import Client

    with Client(stack.target, credentials=stack.credentials("admin")) as admin:
        return sum(admin.pool_stats(w.pool_id).num_used_blocks for w in stack.workers)


def wait_for(predicate, timeout: float = 15.0) -> bool:
    """Polls ``predicate`` every 50 ms until it holds or ``timeout`` passes; its last value."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())
