"""The redis-py exceptions that mean "Redis cannot answer now" rather than "the call is
wrong": unreachable, loading, or a Redis Cluster between owners of a slot (a failover, a
slot moving, no node for it yet). The allocator answers them with UNAVAILABLE, which
clients retry with the same request id; the reaper skips the pool and goes on."""

from __future__ import annotations

from redis.exceptions import (AskError, BusyLoadingError, ClusterError, MasterDownError, RedisClusterException,
                              TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError, ClusterError,
              RedisClusterException, TryAgainError, AskError, MasterDownError)
