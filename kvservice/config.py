"""Settings of the allocator service: one object, from ``KVSERVICE_*`` env vars and CLI flags.

Every field can be set as ``KVSERVICE_<FIELD>`` (upper case) and as ``--<field>`` with
dashes on ``kvservice serve``; flags win over the environment. ``Settings`` checks
itself on creation and raises ``ValueError`` with the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

ENV_PREFIX = "KVSERVICE_"


class EnvSettings:
    """Loading for a settings dataclass: ``<PREFIX><FIELD>`` env vars and ``--<field>`` flags.

    Subclasses are slotted dataclasses that check themselves in ``__post_init__``;
    ``env_prefix`` names their variables.
    """

    __slots__ = ()
    env_prefix = ENV_PREFIX

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any):
        """Settings from the environment, then ``overrides`` (None values ignored)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(cls.env_prefix + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw, cls.env_prefix)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one ``--flag`` per field (default None, so the environment still applies)."""
        for f in fields(cls):
            kind = type(f.default)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                                help=f"default {f.default!r}; env {cls.env_prefix}{f.name.upper()}")

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return cls.from_env(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)



@dataclass(slots=True)
class Settings(EnvSettings):
    """Allocator settings (see docs/allocator.md for what each limit bounds)."""

    host: str = "127.0.0.1"
    port: int = 50051
    #: Redis URL (redis://, rediss://, unix://). Empty: start an embedded Redis.
    redis_url: str = ""
    #: Seconds between sweeps of expired leases.
    reap_interval: float = 0.5
    #: How long a request_id's outcome is kept for retries (seconds).
    request_ttl: float = 600.0
    #: "tenant": each tenant's prompts hash with its own salt; "global": one cache for all.
    prefix_cache_scope: str = "tenant"
    #: Items (updates + creates) in one call.
    max_items_per_call: int = 1024
    #: New blocks one call may allocate.
    max_blocks_per_call: int = 65536
    #: Longest prompt a create accepts (tokens).
    max_prompt_tokens: int = 1 << 20
    #: Children one sequence may fork in one step.
    max_forks_per_sequence: int = 256
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in -1..65535 (-1: off), got {self.metrics_port}")
        if self.prefix_cache_scope not in ("tenant", "global"):
            raise ValueError(f"prefix_cache_scope must be 'tenant' or 'global', got {self.prefix_cache_scope!r}")
        for name in ("reap_interval", "request_ttl", "min_lease_ttl", "max_lease_ttl", "lease_tombstone",
                     "metrics_exporter_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_items_per_call", "max_blocks_per_call", "max_prompt_tokens",
                     "max_forks_per_sequence"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_lease_ttl > self.max_lease_ttl:
            raise ValueError("min_lease_ttl must not exceed max_lease_ttl")


def _parse(f: dataclasses.Field, raw: str, prefix: str) -> Any:
    kind = type(f.default)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{prefix}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
