"""The worker's gRPC server, its registration with the allocator, and heartbeats.

``create_server`` for tests (port 0); ``serve`` for the CLI: builds the pool from the
settings, starts serving (health NOT_SERVING), registers the pool with the allocator —
retrying until it is up — which gives the pool a new epoch, turns health to SERVING,
then heartbeats until SIGINT / SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from typing import TYPE_CHECKING, Any

import grpc
import torch

from kernels.backend import check_cuda_geometry, cuda_available
from kvservice import errors
from kvservice.common import grpc as common_grpc
from kvservice.common.grpc import RETRYABLE, build_server, write_port_file
from kvservice.common.auth import AuthInterceptor, TokenFile
from kvservice.common.interceptor import ErrorInterceptor
from kvservice.common.metrics import MetricsServer
from kvservice.common.security import ClientCredentials, ServerTls, server_tls
from kvservice.v1 import allocator_pb2, allocator_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker import tensors
from worker.config import WorkerSettings, parse_memory
from worker.fence import LeaseFence
from worker.rights import BlockRights
from worker.metrics import WorkerMetrics
from worker.pool import KVPool, PoolShape, blocks_for_budget
from worker.servicer import WorkerServicer
from worker.tiers import DiskTier, HostTier, Tiers, entries_for_budget
from worker.transfer import GrpcTransport, Sources, Staging, keep_freed_memory, serialize_chunk

if TYPE_CHECKING:
    from worker.model import ModelRunner

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
MAX_MESSAGE = 512 << 20


class PoolTakenOver(RuntimeError):
    """The pool id was registered again by someone else: this worker's epoch is stale."""


class PoolDrained(RuntimeError):
    """The pool was drained and unregistered (``kvservice drain``): this worker may stop."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if cuda_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return tensors.DTYPES[name]


def free_memory(device: torch.device) -> int:
    """Free bytes on the device (host: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def model_geometry(settings: WorkerSettings, model: Any) -> tuple[int, int, int, torch.dtype]:
    """``(num_layers, num_kv_heads, head_dim, dtype)`` of a model; logs the settings it overrides."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, model.dtype)
    asked = (settings.num_layers, settings.num_kv_heads, settings.head_dim)
    for name, value, used in zip(("num-layers", "num-kv-heads", "head-dim"), asked, geometry):
        if value != used:
            log.info("--%s %d ignored: the model %s has %d", name, value, settings.model, used)
    if settings.dtype not in ("auto", tensors.NAMES[model.dtype]):
        log.info("--dtype %s ignored: the model %s is %s", settings.dtype, settings.model, tensors.NAMES[model.dtype])
    return geometry


def build_pool(settings: WorkerSettings, model: Any = None) -> KVPool:
    """The pool the settings describe, sized from the memory budget (or ``num_blocks``).

    With ``model`` (a ``worker.llama.Llama``), layers, KV heads, head dim and dtype are the
    model's; block size and budget still come from the settings.
    """
    device = resolve_device(settings.device)
    if model is not None:
        layers, kv_heads, head_dim, dtype = model_geometry(settings, model)
    else:
        layers, kv_heads, head_dim = settings.num_layers, settings.num_kv_heads, settings.head_dim
        dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cuda":
        check_cuda_geometry(head_dim, settings.block_size, dtype)
    shape = PoolShape(1, settings.block_size, layers, kv_heads, head_dim, dtype)
    num_blocks = settings.num_blocks
    if not num_blocks:
        size, fraction = parse_memory(settings.kv_memory)
        budget = size or int(free_memory(device) * fraction)
        num_blocks = blocks_for_budget(budget, shape.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"a KV memory budget of {budget} bytes holds no block of {shape.bytes_per_block} bytes")
    shape = PoolShape(num_blocks, shape.block_size, shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype)
    pool = KVPool(shape, device)
    log.info("KV blocks: %d (%d tokens), %d bytes per block, %.1f MiB on %s (%s backend, %s)", num_blocks,
             shape.num_slots, shape.bytes_per_block, pool.pool_bytes / 2**20, device, pool.backend.name,
             tensors.NAMES[dtype])
    return pool


#: Who may call the Worker service: engines and store clients (tenants) and admins; other
#: workers pull blocks (PullBlocks), and only they.
# Who may call which method. The methods that read or write K/V are a tenant's (an engine,
# a store client: each call proves what its lease may touch with the allocator's grants);
# an admin is for operations, not for bytes (Describe only); a worker only pulls.
ROLES = {**{f"/{SERVICE_NAME}/{method}": frozenset(("tenant",))
            for method in ("WriteKV", "ReadKV", "Attention", "CopyBlocks", "Forward", "MoveBlocks", "FetchBlocks",
                           "WriteBlocks", "ReadBlocks")},
         f"/{SERVICE_NAME}/Describe": frozenset(("tenant", "admin")),
         f"/{SERVICE_NAME}/PullBlocks": frozenset(("worker",))}


def build_tiers(settings: WorkerSettings, pool: KVPool) -> Tiers | None:
    """The pool's lower tiers from the settings (None: none): a host tier of
    ``host_tier_gb``, a disk tier of ``disk_tier_gb`` in ``disk_tier_dir``."""
    if not settings.host_tier_gb:
        return None
    host_entries = entries_for_budget(int(settings.host_tier_gb * 1e9), pool.shape)
    host = HostTier(pool.shape, host_entries, pin=pool.device.type == "cuda")
    disk = None
    if settings.disk_tier_dir:
        disk = DiskTier(pool.shape, entries_for_budget(int(settings.disk_tier_gb * 1e9), pool.shape),
                        settings.disk_tier_dir, settings.pool_id)
    log.info("pool %s: a host tier of %d blocks (%.1f MB at %#x)%s", settings.pool_id, host_entries,
             host.data.numel() / 1e6, host.data.data_ptr(),
             f", a disk tier of {disk.num_entries} blocks in {disk.path} ({'new' if disk.created else 'kept'})"
             if disk else "")
    return Tiers(pool, host, disk)


async def create_server(pool: KVPool, pool_id: str, address: str, allocator: str = "",
                        runner: ModelRunner | None = None, metrics: WorkerMetrics | None = None,
                        tokens: TokenFile | None = None, tls: ServerTls | None = None,
                        fence: LeaseFence | None = None, tiers: Tiers | None = None,
                        sources: Sources | None = None
                        ) -> tuple[grpc.aio.Server, int, common_grpc.HealthServicer]:
    """A not-yet-started server with the Worker, health and reflection services
    (``runner``: the model ``Forward`` serves; None: K/V only; ``metrics``: RPCs are timed).
    With ``tokens``, or ``tls`` with a client CA, every Worker call is authenticated and
    checked against ``ROLES``, and every write must name its lease; ``fence``: the dead
    leases whose writes are refused (the registrar's heartbeats fill it); ``sources``:
    where other pools' workers are (``FetchBlocks``; None: fetches refused).

    Returns the server, the bound port and the health servicer (NOT_SERVING until the
    caller marks the pool registered).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
    certificates = tls is not None and bool(tls.client_ca)
    authenticated = tokens is not None or certificates
    if authenticated:
        interceptors.insert(0, AuthInterceptor(ROLES, tokens, certificates))
    if metrics is not None:
        interceptors.insert(0, metrics.interceptor)
    if fence is None:
        fence = LeaseFence()
    fence.require_lease = fence.require_lease or authenticated
    if allocator and fence.rights is None:
        fence.rights = BlockRights(pool.shape.num_blocks, pool_id)
    servicer = WorkerServicer(pool, pool_id, allocator, runner, fence, tiers, sources)
    if metrics is not None:
        metrics.store = servicer.store
    return await build_server(address, [(add_worker_servicer, servicer)], [SERVICE_NAME],
                              interceptors=interceptors, max_message=MAX_MESSAGE, serving=False,
                              credentials=tls.credentials() if tls else None)


def add_worker_servicer(servicer: WorkerServicer, server: grpc.aio.Server) -> None:
    """The generated ``add_WorkerServicer_to_server``, but for PullBlocks and ReadBlocks,
    whose messages the servicer serializes itself (``worker.transfer.serve``: a block's
    bytes are copied once into its message, not into a BlockChunk and again into its
    serialization)."""

    class Capture:
        handlers: dict[str, grpc.RpcMethodHandler] = {}

        def add_generic_rpc_handlers(self, generic: Any) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            Capture.handlers = dict(handlers)

    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, Capture())
    handlers = Capture.handlers
    for name, behaviour, request in (("PullBlocks", servicer.PullBlocks, worker_pb2.PullBlocksRequest),
                                     ("ReadBlocks", servicer.ReadBlocks, worker_pb2.ReadBlocksRequest)):
        handlers[name] = grpc.unary_stream_rpc_method_handler(behaviour, request_deserializer=request.FromString,
                                                              response_serializer=serialize_chunk)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def set_serving(health_servicer: common_grpc.HealthServicer, serving: bool) -> None:
    """Marks the Worker service (and the server) SERVING or NOT_SERVING."""
    await common_grpc.set_serving(health_servicer, serving, [SERVICE_NAME])


class Registrar:
    """Registers the pool with the allocator and keeps it alive with heartbeats; tells the
    fence the dead leases and the pool's generation, and lets it ask for them at once
    (``refresh``)."""

    def __init__(self, pool: KVPool, pool_id: str, allocator: str, advertise: str, timeout: float,
                 credentials: ClientCredentials | None = None, fence: LeaseFence | None = None,
                 tiers: Tiers | None = None, role: str = "both") -> None:
        self.pool = pool
        self.tiers = tiers
        self.role = role
        self.fence = fence if fence is not None else LeaseFence()
        self.pool_id = pool_id
        self.address = advertise
        self.timeout = timeout
        self.channel = (credentials or ClientCredentials()).aio_channel(allocator)
        self.stub = allocator_pb2_grpc.AllocatorStub(self.channel)
        #: A heartbeat asked by the fence found the pool registered again elsewhere.
        self.taken_over: PoolTakenOver | None = None
        self.registered = False
        self.fence.refresh = self.refresh

    async def register(self) -> int:
        """Registers (a new epoch), retrying while the allocator is unreachable."""
        s = self.pool.shape
        request = allocator_pb2.RegisterPoolRequest(
            pool_id=self.pool_id, worker_address=self.address, request_id=uuid.uuid4().hex,
            geometry=s.geometry.to_pb(), role=self.role)
        if self.tiers is not None:
            host, disk = self.tiers.host, self.tiers.disk
            request.host_tier_blocks = host.num_entries if host else 0
            request.disk_tier_blocks = disk.num_entries if disk else 0
            # (the disk tier's file holds what the allocator knows of: an earlier process's
            # entries, or this one's after its first registration)
            request.disk_tier_kept = disk is not None and (not disk.created or self.registered)
        start, delay, attempts = time.monotonic(), 0.1, 0
        while True:
            attempts += 1
            try:
                reply = await self.stub.RegisterPool(request, timeout=10)
                break
            except grpc.aio.AioRpcError as exc:
                waited = time.monotonic() - start
                if exc.code() not in RETRYABLE or (self.timeout and waited > self.timeout):
                    raise RuntimeError(f"cannot register pool {self.pool_id}: {exc.code().name}: {exc.details()}")
                if attempts == 1 or attempts % 10 == 0:
                    log.info("allocator not reachable yet (%s); retrying", exc.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.pool.epoch = reply.epoch
        self.fence.generation = reply.generation
        if self.fence.rights is not None:
            self.fence.rights.reset(reply.epoch, reply.grant_key)
        self.registered = True
        log.info("pool %s registered at epoch %d (%d blocks of %d tokens)", self.pool_id, reply.epoch,
                 s.num_blocks, s.block_size)
        return reply.epoch

    async def describe(self, pool_id: str) -> tuple[str, int]:
        """Another pool's worker address and epoch, from the allocator's registry.

        Raises:
            NotFound: no such pool; Unavailable: the allocator cannot be reached.
        """
        try:
            p = await self.stub.DescribePool(allocator_pb2.DescribePoolRequest(pool_id=pool_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise errors.NotFound(f"no pool {pool_id} is registered") from None
            raise errors.Unavailable(f"the allocator could not say where pool {pool_id} is: "
                                     f"{exc.code().name}: {exc.details()}") from None
        return p.worker_address, p.epoch

    async def heartbeat(self) -> None:
        """One heartbeat; re-registers if the allocator forgot the pool; raises
        PoolTakenOver if the pool was registered again by another process."""
        try:
            reply = await self.stub.Heartbeat(allocator_pb2.HeartbeatRequest(
                pool_id=self.pool_id, epoch=self.pool.epoch, dead_since_ms=self.fence.dead_until_ms), timeout=10)
            self.fence.learn(list(reply.dead_leases), reply.dead_until_ms)
            if self.fence.generation != reply.generation:
                log.warning("pool %s is at generation %d (was %s): its Redis restarted or failed over; writes of "
                            "clients that have not resynchronised are refused", self.pool_id, reply.generation,
                            self.fence.generation)
                self.fence.generation = reply.generation
                if self.fence.rights is not None:
                    self.fence.rights.clear()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                log.warning("the allocator does not know pool %s (its state was reset): registering again",
                            self.pool_id)
                await self.register()
            elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                if "drained" in (exc.details() or ""):
                    raise PoolDrained(exc.details()) from None
                if await self._registration_lost():
                    log.warning("pool %s is at an older epoch than %d (its Redis lost the registration): "
                                "registering again", self.pool_id, self.pool.epoch)
                    await self.register()
                    return
                raise PoolTakenOver(exc.details()) from None
            else:
                log.warning("heartbeat failed: %s: %s", exc.code().name, exc.details())

    async def _registration_lost(self) -> bool:
        """Whether the pool's epoch is below this worker's: its Redis lost the registration
        (rolled back), rather than another process registering the pool again."""
        try:
            pool = await self.stub.DescribePool(allocator_pb2.DescribePoolRequest(pool_id=self.pool_id), timeout=10)
        except grpc.aio.AioRpcError:
            return False
        return pool.epoch < self.pool.epoch

    async def refresh(self) -> None:
        """A heartbeat now (the fence's: a write carried a generation the worker had not
        heard); a takeover it finds is kept for the heartbeat loop."""
        try:
            await self.heartbeat()
        except PoolTakenOver as exc:
            self.taken_over = exc

    async def close(self) -> None:
        await self.channel.close()


async def serve(settings: WorkerSettings, port_file: str | None = None) -> int:
    """Serves until SIGINT / SIGTERM (exit 0), or until the pool is taken over (exit 3)."""
    # Credentials first: a missing file stops the worker before the pool is allocated.
    tokens = TokenFile(settings.tokens_file) if settings.tokens_file else None
    tls = server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    if tls is not None:
        tls.credentials()
    credentials = ClientCredentials.from_env()
    fence = LeaseFence()
    keep_freed_memory()     # (the messages of block transfers: worker/transfer.py)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    runner = None
    if settings.model:
        from worker.model import ModelRunner, build_model

        model = build_model(settings.model, settings.model_seed)
        pool = build_pool(settings, model)
        runner = ModelRunner(model.to(pool.device), pool, settings.model, settings.model_seed)
        log.info("model %s (seed %d): %d parameters on %s", settings.model, settings.model_seed,
                 sum(p.numel() for p in model.parameters()), pool.device)
    else:
        pool = build_pool(settings)
    tiers = build_tiers(settings, pool)
    metrics = http = None
    if settings.metrics_port >= 0:
        metrics = WorkerMetrics(settings.pool_id, pool, runner, fence)
        metrics.tiers = tiers
        metrics.attach()
    sources = Sources(GrpcTransport(credentials), staging=Staging(settings.shared_memory_dir)) \
        if settings.allocator else None
    if metrics is not None:
        metrics.sources = sources
    server, port, health_servicer = await create_server(pool, settings.pool_id, f"{settings.host}:{settings.port}",
                                                        settings.allocator, runner, metrics, tokens, tls, fence,
                                                        tiers, sources)
    await server.start()
    if metrics is not None:
        http = MetricsServer(metrics.registry, settings.host, settings.metrics_port)
        print(f"metrics on http://{settings.host}:{http.port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvservice worker {settings.pool_id} listening on {settings.host}:{port}", flush=True)
    registrar = None
    code = 0
    try:
        if settings.allocator:
            advertise = settings.advertise or f"{settings.host}:{port}"
            registrar = Registrar(pool, settings.pool_id, settings.allocator, advertise, settings.register_timeout,
                                  credentials, fence, tiers, settings.role)
            if sources is not None:
                sources.describe = registrar.describe
            registering = asyncio.ensure_future(registrar.register())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([registering, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not registering.done():
                registering.cancel()
                return 0
            stopping.cancel()
            registering.result()
        else:
            pool.epoch = 1
            log.info("standalone: no allocator; pool %s serves epoch 1", settings.pool_id)
        await set_serving(health_servicer, True)
        if port_file:
            write_port_file(port_file, port, settings.pool_id, http.port if http else -1)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.heartbeat_interval)
            if registrar is not None and not stop.is_set():
                await registrar.heartbeat()
                if registrar.taken_over is not None:
                    raise registrar.taken_over
    except PoolTakenOver as exc:
        log.error("pool %s was registered again elsewhere; this worker stops: %s", settings.pool_id, exc)
        code = 3
    except PoolDrained as exc:
        log.info("pool %s was drained; this worker stops (start it again to serve a new pool): %s",
                 settings.pool_id, exc)
        code = 0
    finally:
        await set_serving(health_servicer, False)
        await server.stop(grace=2)
        if http is not None:
            http.stop()
        if registrar is not None:
            await registrar.close()
        if tiers is not None:
            tiers.close()
        if sources is not None:
            await sources.transport.close()
            if sources.staging is not None:
                sources.staging.close()
    return code
