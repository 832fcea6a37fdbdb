"""Worker settings: one object, from ``KVSERVICE_WORKER_*`` env vars and CLI flags."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from kvservice.common.geometry import check_dims
from kvservice.common.settings import (EnvSettings, check_block_size, check_in_range, check_pool_id, check_ports,
                                      check_positive, check_server_security)

DTYPES = ("auto", "float32", "float16", "bfloat16")
#: The presets of worker/model.py and worker/weights.py (kept here so that checking flags
#: needs no torch).
MODEL_NAMES = ("tiny-llama", "small-llama", "tiny-llama-long", "smollm2-135m")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(slots=True)
class WorkerSettings(EnvSettings):
    """A worker's settings (see docs/workers.md)."""

    env_prefix: ClassVar[str] = "KVSERVICE_WORKER_"

    host: str = "127.0.0.1"
    port: int = 50061
    #: Port of the Prometheus /metrics endpoint (on ``host``); 0: any free port; -1: off.
    metrics_port: int = 9401
    #: Address registered with the allocator for clients to reach (default host:port).
    advertise: str = ""
    #: The allocator's host:port; empty: standalone (epoch 1, nothing registered).
    allocator: str = ""
    pool_id: str = "worker-0"
    #: KV memory budget: a size ("2GiB", "512MB", "1073741824") or a fraction in (0, 1]
    #: of the device's free memory ("0.9").
    kv_memory: str = "256MiB"
    #: Exact number of blocks (overrides kv_memory when > 0).
    num_blocks: int = 0
    block_size: int = 16
    #: A model preset to serve with Forward (tiny-llama, small-llama: seeded weights;
    #: smollm2-135m: SmolLM2-135M-Instruct, converted once into $KVSERVICE_MODEL_CACHE);
    #: empty: K/V only. With a model, num_layers, num_kv_heads, head_dim and dtype come
    #: from the model.
    model: str = ""
    #: The seed the weights of a seeded preset are drawn with.
    model_seed: int = 0
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    #: "auto": bfloat16 on a GPU, float32 on a CPU.
    dtype: str = "auto"
    #: "auto": cuda:0 when CUDA (and CuPy) are available, else cpu.
    device: str = "auto"
    #: torch's CPU threads (the model on a CPU; 0: torch's default, one per core). Workers
    #: sharing a host share its cores: give each its part (kvservice up does), or their
    #: threads oversubscribe the cores and every step slows down several times.
    torch_threads: int = 0
    #: The pool's host tier (DESIGN §12): GB (10^9 bytes) of host memory (pinned on a CUDA
    #: device) that keeps blocks evicted from the device; 0: none.
    host_tier_gb: float = 0.0
    #: The pool's disk tier: a directory for its file (``<pool id>.kvtier``), which keeps
    #: blocks evicted from the host tier and outlives the process; empty: none.
    disk_tier_dir: str = ""
    #: The disk tier's size, GB (with disk_tier_dir).
    disk_tier_gb: float = 1.0
    #: What the engine runs on this worker's pool (DESIGN §13): "both"; "prefill" (prompts
    #: are computed here, then their sequences move to a decode worker); "decode"; or
    #: "store": K/V only, the bytes behind a KV store that external engines' connectors
    #: write and read (DESIGN §15, docs/integrations.md).
    role: str = "both"
    #: Where fetches between workers of this machine put their blocks (a tmpfs directory,
    #: docs/workers.md "Blocks between workers"): a staging file the source writes and the
    #: destination reads, in place of the stream's bytes; empty: always in the stream.
    shared_memory_dir: str = "/dev/shm"
    #: Seconds between heartbeats to the allocator.
    heartbeat_interval: float = 2.0
    #: Give up registering after this many seconds (0: keep trying).
    register_timeout: float = 60.0
    log_level: str = "INFO"
    #: Who may call the Worker service (docs/security.md): a tokens file (the
    #: allocator's format), and/or client certificates of ``tls_client_ca``. Neither: nobody
    #: is authenticated (a development worker on loopback). The worker's own credentials
    #: towards the allocator are the SDK's variables (KVSERVICE_TOKEN_FILE, KVSERVICE_TLS_CA,
    #: KVSERVICE_CLIENT_CERT, KVSERVICE_CLIENT_KEY).
    tokens_file: str = ""
    #: TLS (PEM files): the worker's certificate chain and key, and the CA of client
    #: certificates (mTLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    #: Allow plaintext on a host beyond loopback (otherwise refused).
    insecure: bool = False

    def __post_init__(self) -> None:
        check_ports(self)
        check_server_security(self, "the worker")
        check_pool_id(self.pool_id)
        parse_memory(self.kv_memory)
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        check_block_size(self.block_size)
        check_dims(self.num_layers, self.num_kv_heads, self.head_dim)
        if self.model and self.model not in MODEL_NAMES:
            raise ValueError(f"model must be one of {', '.join(MODEL_NAMES)} (or empty), got {self.model!r}")
        check_in_range("model_seed", self.model_seed, 0, 2**63 - 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:<n>, got {self.device!r}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if not (0 <= self.host_tier_gb < 1e6) or not (0 < self.disk_tier_gb < 1e6):
            raise ValueError(f"host_tier_gb must be >= 0 and disk_tier_gb > 0 (GB), got {self.host_tier_gb} "
                             f"and {self.disk_tier_gb}")
        if self.role not in ("both", "prefill", "decode", "store"):
            raise ValueError(f"role must be both, prefill, decode or store, got {self.role!r}")
        if self.role == "store" and self.model:
            raise ValueError("a store worker (role store) serves K/V only: no model")
        if self.disk_tier_dir and not self.host_tier_gb:
            raise ValueError("a disk tier (disk_tier_dir) keeps blocks evicted from the host tier: "
                             "give host_tier_gb too")
        check_positive(self, "heartbeat_interval")
        check_positive(self, "register_timeout", allow_zero=True)


def parse_memory(text: str) -> tuple[int, float]:
    """``"2GiB"`` -> (2147483648, 0.0); ``"0.9"`` -> (0, 0.9): bytes, or a fraction of free memory."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_memory {text!r} is neither a size (e.g. 2GiB, 512MB) nor a fraction in (0, 1]")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and value <= 1:
        if value <= 0:
            raise ValueError(f"kv_memory fraction must be in (0, 1], got {text!r}")
        return 0, value
    size = int(value * _UNITS[unit])
    if size < 1:
        raise ValueError(f"kv_memory {text!r} is less than one byte")
    return size, 0.0
