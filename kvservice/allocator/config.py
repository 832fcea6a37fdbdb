"""Settings of the allocator service: one object, from ``KVSERVICE_*`` env vars and CLI flags.

Every field can be set as ``KVSERVICE_<FIELD>`` (upper case) and as ``--<field>`` with
dashes on ``kvservice serve``; flags win over the environment. ``Settings`` checks
itself on creation and raises ``ValueError`` with the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.common.settings import (TENANT_NAME, EnvSettings, check_in_range, check_ports, check_positive,
                                      check_server_security)


@dataclass(slots=True)
class Settings(EnvSettings):
    """Allocator settings (see docs/allocator.md for what each limit bounds)."""

    host: str = "127.0.0.1"
    port: int = 50051
    #: Redis URL (redis://, rediss://, unix://), with its credentials
    #: (``redis://user:password@host:6379/0``). Empty: start an embedded Redis (which
    #: takes only the allocator's generated ACL user). Give it by environment or file
    #: rather than by flag: a command line is what ``ps`` shows.
    redis_url: str = ""
    #: A file whose first line is the Redis URL (a mounted Secret); wins over redis_url.
    redis_url_file: str = ""
    #: Connections to Redis at most; a call that finds none free waits up to
    #: ``redis_pool_timeout`` seconds for one (then UNAVAILABLE).
    redis_max_connections: int = 64
    redis_pool_timeout: float = 10.0
    #: "auto": a Redis Cluster client when the URL's server is a cluster node (it answers
    #: CLUSTER SLOTS); "on" / "off" to say so.
    redis_cluster: str = "auto"
    #: Durability (docs/operations.md, "Redis Cluster"): after each script that hands out
    #: or frees blocks (a step, a Sync, a resync, a reap), wait until this many replicas of
    #: its shard hold its writes (Redis ``WAIT``), at most ``redis_wait_timeout_ms``; a
    #: call that got fewer acknowledgements fails with UNAVAILABLE (its retry, same request
    #: id, returns the same outcome). 0: no waiting (a failover may lose the last writes).
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 100
    #: The largest request or reply, in MiB (a larger request is refused before it is read).
    max_message_mb: int = 16
    #: Seconds between sweeps of expired leases (each sweeps the pools that are due:
    #: ``kvservice/allocator/reaping.py``).
    reap_interval: float = 0.5
    #: The longest a pool goes unswept (seconds): how late, at worst, a lease is reaped
    #: when the replica that served it died before it (a revoked lease is reaped at once).
    reap_recheck: float = 30.0
    #: How long a request_id's outcome is kept for retries (seconds).
    request_ttl: float = 600.0
    #: Seconds without a heartbeat from a pool's worker after which placement puts the
    #: pool after every other (workers heartbeat every 2 s by default).
    placement_silence: float = 6.0
    #: KV events (DESIGN §15): pools registered from now on record their cache changes (a
    #: Redis stream per pool, written by the scripts that make them) and the token ids of
    #: their blocks (``kvs:tok:<hash>``, an hour), for ``kvservice events`` to publish in
    #: vLLM's format (docs/integrations.md).
    kv_events: bool = False
    #: How long a read pin holds another pool's blocks for a create's fetch (seconds,
    #: DESIGN §13): the fetch runs before the create's first forward and its client
    #: releases the pin then; one never released (its client died) ends at this deadline.
    fetch_pin_ttl: float = 30.0
    #: "tenant": each tenant's prompts hash with its own salt; "global": one cache for all.
    prefix_cache_scope: str = "tenant"
    #: Tenants that share one prefix cache: ``group=tenant,tenant;group2=...`` (each tenant
    #: in one group at most). The others keep their own.
    prefix_cache_groups: str = ""
    #: A file whose first line is a secret mixed into every salt (HMAC-SHA256): hashes
    #: then reveal nothing of a prompt to whoever lacks it. Every replica needs the same.
    prefix_cache_secret_file: str = ""
    #: The per-call limits below keep every script call under ~10 ms of Redis (each stalls
    #: every other caller while it runs: docs/security.md, "Limits"; ``kvservice limits``
    #: measures the worst call they allow).
    #: Items (updates + creates) in one Step.
    max_items_per_call: int = 128
    #: New blocks one script call may allocate, and the blocks of its creates in all
    #: (cached or new): a larger create is staged over several calls (docs/allocator.md,
    #: "Big operations in bounded calls").
    max_blocks_per_call: int = 512
    #: The longest sequence (tokens): a prompt, a growth or a fork past it is refused.
    #: Beyond that, a sequence's size is the pool's business (its blocks, the tenant's
    #: quota), not a call's.
    max_sequence_tokens: int = 1 << 22
    #: Blocks one script call's frees may release (a longer sequence is freed in parts).
    max_release_per_call: int = 512
    #: A Sync's journal, per pool: entries and blocks at most (the allocator applies it
    #: in script calls of at most ~128 entries, each under the same ~10 ms), and blocks
    #: given back at most.
    max_journal_entries: int = 1024
    max_journal_blocks: int = 65536
    max_returned_blocks: int = 4096
    #: Children one sequence may fork in one step.
    max_forks_per_sequence: int = 256
    #: Children one call (a Step, or a Sync's journal) may fork in all...
    max_forks_per_call: int = 128
    #: ... and block references they may add (each child: its parent's blocks).
    max_fork_refs_per_call: int = 4096
    #: A lease's reserve in one pool: at most this share of the pool's blocks...
    reserve_share: float = 0.01
    #: ... and never less than this many blocks.
    reserve_min_blocks: int = 4
    #: Blocks one Sync's background refill grants at most (the next Sync grants more; what
    #: a step needs at once is bounded by max_blocks_per_call instead).
    max_refill_per_call: int = 1024
    #: While a pool's free + evictable blocks are below this share of it, the cap drops
    #: to ``reserve_min_blocks`` (clients return their surplus).
    reserve_pressure_share: float = 0.05
    #: Quotas of every tenant (0: none; docs/security.md): blocks it holds in one pool (one
    #: per block reference in its sequences' tables, plus its reserves), its sequences in
    #: one pool (with the sequence numbers granted to it and not used yet), its live leases.
    quota_blocks: int = 0
    quota_sequences: int = 0
    quota_leases: int = 0
    #: Quotas of named tenants, beside those: ``tenant=blocks:N,sequences:N,leases:N;...``
    #: (a quota left out is the default one; 0: none).
    quotas: str = ""
    #: Lease TTL bounds (seconds).
    min_lease_ttl: float = 0.1
    max_lease_ttl: float = 3600.0
    #: How long expired leases and their tombstones are remembered (seconds).
    lease_tombstone: float = 3600.0
    #: Port of the Prometheus /metrics endpoint (on ``host``); 0: any free port; -1: off.
    metrics_port: int = 9400
    #: Seconds the metrics exporter lease lasts without a scrape (see docs/operations.md).
    metrics_exporter_ttl: float = 30.0
    log_level: str = "INFO"
    #: The tokens file (docs/security.md): hashed bearer tokens -> identity and role.
    #: Empty, and no ``tls_client_ca``: nobody is authenticated (a development server).
    tokens_file: str = ""
    #: TLS (PEM files): the server's certificate chain and key; with ``tls_client_ca``,
    #: every client must present a certificate that CA signed (mTLS), whose CN and O are
    #: an identity and its role.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    #: Allow plaintext on a host beyond loopback (otherwise refused).
    insecure: bool = False

    def __post_init__(self) -> None:
        check_ports(self)
        check_server_security(self, "the allocator")
        if self.redis_cluster not in ("auto", "on", "off"):
            raise ValueError(f"redis_cluster must be auto, on or off, got {self.redis_cluster!r}")
        if self.prefix_cache_scope not in ("tenant", "global"):
            raise ValueError(f"prefix_cache_scope must be 'tenant' or 'global', got {self.prefix_cache_scope!r}")
        cache_groups(self.prefix_cache_groups)
        for name in ("quota_blocks", "quota_sequences", "quota_leases"):
            check_in_range(name, getattr(self, name), 0, 2**31 - 1)
        tenant_quotas(self.quotas)
        check_positive(self, "reap_interval", "reap_recheck", "request_ttl", "placement_silence", "fetch_pin_ttl",
                       "min_lease_ttl", "max_lease_ttl", "lease_tombstone", "metrics_exporter_ttl", "redis_pool_timeout")
        check_in_range("redis_max_connections", self.redis_max_connections, 1, 10_000)
        check_in_range("redis_wait_replicas", self.redis_wait_replicas, 0, 16)
        check_in_range("redis_wait_timeout_ms", self.redis_wait_timeout_ms, 1, 60_000)
        check_in_range("max_message_mb", self.max_message_mb, 1, 1024)
        for name in ("max_items_per_call", "max_blocks_per_call", "max_sequence_tokens", "max_forks_per_sequence",
                     "max_forks_per_call", "max_fork_refs_per_call", "max_refill_per_call",
                     "max_release_per_call", "max_journal_entries", "max_journal_blocks", "max_returned_blocks"):
            check_in_range(name, getattr(self, name), 1, 2**31 - 1)
        if not (0 <= self.reserve_share <= 1 and 0 <= self.reserve_pressure_share <= 1):
            raise ValueError("reserve_share and reserve_pressure_share must be in 0..1")
        check_in_range("reserve_min_blocks", self.reserve_min_blocks, 0, 1 << 20)
        if self.min_lease_ttl > self.max_lease_ttl:
            raise ValueError("min_lease_ttl must not exceed max_lease_ttl")


def cache_groups(text: str) -> dict[str, str]:
    """``prefix_cache_groups`` parsed: tenant -> its group.

    Raises:
        ValueError: a malformed entry, or a tenant in two groups.
    """
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        group, sep, members = entry.partition("=")
        group = group.strip()
        tenants = [t.strip() for t in members.split(",") if t.strip()]
        if not sep or not TENANT_NAME.fullmatch(group) or not tenants:
            raise ValueError(f"prefix_cache_groups: {entry!r} is not group=tenant,tenant...")
        for t in tenants:
            if not TENANT_NAME.fullmatch(t):
                raise ValueError(f"prefix_cache_groups: malformed tenant {t!r} in group {group}")
            if t in out:
                raise ValueError(f"prefix_cache_groups: tenant {t} is in groups {out[t]} and {group}")
            out[t] = group
    return out


QUOTA_NAMES = ("blocks", "sequences", "leases")


def tenant_quotas(text: str) -> dict[str, dict[str, int]]:
    """``quotas`` parsed: tenant -> {quota name: limit} for the quotas it names.

    Raises:
        ValueError: a malformed entry, an unknown quota, a tenant named twice.
    """
    out: dict[str, dict[str, int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        tenant, sep, items = entry.partition("=")
        tenant = tenant.strip()
        if not sep or not TENANT_NAME.fullmatch(tenant) or not items.strip():
            raise ValueError(f"quotas: {entry!r} is not tenant=blocks:N,sequences:N,leases:N")
        if tenant in out:
            raise ValueError(f"quotas: tenant {tenant} is named twice")
        limits: dict[str, int] = {}
        for item in items.split(","):
            name, _, value = item.strip().partition(":")
            if name not in QUOTA_NAMES or not value.isascii() or not value.isdigit() or int(value) >= 2**31:
                raise ValueError(f"quotas: {item.strip()!r} for tenant {tenant} is not one of "
                                 f"{', '.join(n + ':N' for n in QUOTA_NAMES)} (N in 0..2^31-1)")
            limits[name] = int(value)
        out[tenant] = limits
    return out

