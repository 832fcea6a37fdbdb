"""Settings loading (``<PREFIX><FIELD>`` env vars and ``--<field>`` flags) and the checks
that the allocator's and the worker's settings share.

A settings class is a slotted dataclass that derives from ``EnvSettings`` and checks
itself in ``__post_init__`` with the functions below, which raise ``ValueError`` naming
the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import fields
from typing import Any

ENV_PREFIX = "KVSERVICE_"
#: Pool ids: letters, digits, ``_ . -``; at most 64; no ``:`` (it separates key families).
POOL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: Tenant (and identity, group) names.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
#: The largest block size a pool may have (a power of two).
MAX_BLOCK_SIZE = 256


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
        import os

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
            flag = "--" + f.name.replace("_", "-")
            env = f"env {cls.env_prefix}{f.name.upper()}"
            if kind is bool:
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                    help=f"default {'on' if f.default else 'off'}; {env} (1 or 0)")
            else:
                parser.add_argument(flag, dest=f.name, type=kind, default=None, help=f"default {f.default!r}; {env}")

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return cls.from_env(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False,
          "": False}


def _parse(f: dataclasses.Field, raw: str, prefix: str) -> Any:
    kind = type(f.default)
    if kind is bool:
        if raw.strip().lower() not in _BOOLS:
            raise ValueError(f"{prefix}{f.name.upper()}={raw!r} is not a boolean (1 or 0)")
        return _BOOLS[raw.strip().lower()]
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{prefix}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None


# ------------------------------------------------------------------ shared checks


def check_ports(settings: Any) -> None:
    """``port`` in 0..65535 and ``metrics_port`` in -1..65535 (-1: off)."""
    if not 0 <= settings.port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {settings.port}")
    if not -1 <= settings.metrics_port <= 65535:
        raise ValueError(f"metrics_port must be in -1..65535 (-1: off), got {settings.metrics_port}")


def check_in_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")


def check_positive(settings: Any, *names: str, allow_zero: bool = False) -> None:
    """Each named field is a finite number > 0 (>= 0 with ``allow_zero``)."""
    for name in names:
        value = getattr(settings, name)
        if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
            raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_server_security(settings: Any, what: str) -> None:
    """The TLS files go together, and plaintext beyond loopback needs ``insecure``
    (fields ``host``, ``tls_cert``, ``tls_key``, ``tls_client_ca``, ``insecure``)."""
    from kvservice.common.security import check_listen, server_tls

    tls = server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    check_listen(settings.host, tls is not None, settings.insecure, what)


def check_block_size(block_size: int) -> None:
    if not (1 <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size must be a power of two in 1..{MAX_BLOCK_SIZE}, got {block_size}")


def check_pool_id(pool_id: str) -> None:
    if not POOL_ID.fullmatch(pool_id or ""):
        raise ValueError(f"malformed pool_id {echo(pool_id)} (letters, digits, _ . -; at most 64)")


def echo(value: Any, limit: int = 100) -> str:
    """``repr(value)``, cut to about ``limit`` characters: what an error message may quote
    of a caller's value (a reply's status must stay far below gRPC's metadata limits)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
