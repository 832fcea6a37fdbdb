"""The service as processes: serve with an embedded Redis, health, reflection, the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from urllib.parse import urlsplit

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvservice.client import Client
from kvservice.allocator import keys
from kvservice.allocator.embedded import EmbeddedRedis, available_flavors
from kvservice.tools.launcher import AllocatorProcess

pytestmark = pytest.mark.e2e


def test_serve_without_redis_url_starts_and_stops_a_private_redis_that_takes_only_its_acl_user():
    with AllocatorProcess() as proc:
        assert proc.url.startswith("unix://kvservice:")
        socket_path = urlsplit(proc.url).path
        assert redis.Redis.from_url(proc.url).ping()
        # No connection without credentials; the allocator's user runs only its commands.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=socket_path).ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(proc.url).flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(proc.url).config_get("*")
        # ... and nothing on its command line shows a password.
        with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
            assert urlsplit(proc.url).password.encode() not in f.read()
        with Client(proc.target) as c:
            c.register_pool("e0", num_blocks=8, block_size=4)
            assert c.create([1, 2, 3], pool="e0").block_table == [0]
    assert proc.proc.returncode == 0
    assert not os.path.exists(socket_path)


def test_health_and_reflection_are_served(server):
    with server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvservice.v1.Allocator"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        listed = health.List(health_pb2.HealthListRequest(), timeout=5)
        assert {name: r.status for name, r in listed.statuses.items()} == {
            "": health_pb2.HealthCheckResponse.SERVING, "kvservice.v1.Allocator": health_pb2.HealthCheckResponse.SERVING}
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"kvservice.v1.Allocator", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("flavor", available_flavors())
def test_embedded_servers_run_redis_6_2_or_newer(flavor):
    with EmbeddedRedis(flavor) as r:
        major, minor = (int(x) for x in r.version().split(".")[:2])
        assert (major, minor) >= (6, 2)
        info = redis.Redis.from_url(r.url).info("server")
        assert info["redis_version"].startswith(f"{major}.") or "valkey" in str(info).lower()


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "kvservice", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("serve", "up", "api", "audit", "bench", "limits", "demo"):
        assert cmd in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--redis-url" in out.stdout and "KVSERVICE_REDIS_URL" in out.stdout


def test_serve_rejects_bad_settings():
    out = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--prefix-cache-scope", "nope"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "prefix_cache_scope" in out.stderr


def test_demo_prints_answers_in_text_and_its_report(smollm2_cache):
    out = subprocess.run([sys.executable, "-m", "kvservice", "demo"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    answers, report = out.stdout.split("\nreport (")
    assert "[r0] What is the capital of France?" in answers and "Paris" in answers.split("[r1]")[0]
    cached = [int(c) for c in re.findall(r"(\d+) from the prefix cache", answers)]
    # Two system prompts, shared: at most the first of each in each of the two pools misses.
    assert len(cached) == 12 and sum(c > 0 for c in cached) >= 12 - 2 * 2
    assert answers.count("4 samples") == 3 and "<|im_" not in answers
    for line in ("requests completed", "tokens generated", "KV blocks used at peak", "KV utilization at peak",
                 "prefix-cache hit tokens", "copy-on-write block copies", "memory saved by sharing"):
        assert line in report, line
    turn = re.search(r"a second turn of the first 3 chats: (\d+) of their (\d+) prompt tokens cached, (\d+) blocks "
                     r"of them loaded from the host tier", report)
    assert turn and int(turn.group(3)) > 0 and int(turn.group(1)) >= 16 * int(turn.group(3)), report
    assert "12/12 done" in out.stderr          # progress
    assert "audit: ok; blocks in use after the run: 0" in out.stderr


def test_a_killed_allocator_takes_its_private_redis_with_it():
    proc = AllocatorProcess().start()
    socket_path = urlsplit(proc.url).path
    assert redis.Redis.from_url(proc.url).ping()
    proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not os.path.exists(socket_path):
            break
        try:
            redis.Redis.from_url(proc.url, socket_timeout=0.5).ping()
        except (redis.ConnectionError, FileNotFoundError, OSError):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the embedded Redis outlived its SIGKILLed allocator")
    proc.stop()


def test_heartbeat_stamps_the_pool_at_its_epoch_and_a_new_epoch_rejects_the_old_one(client):
    from kvservice import errors
    from kvservice.v1 import allocator_pb2 as pb

    pool = client.register_pool("hb", num_blocks=8, block_size=4)
    assert client.stub.DescribePool(pb.DescribePoolRequest(pool_id="hb")).last_heartbeat_ms == 0
    beat = client.stub.Heartbeat(pb.HeartbeatRequest(pool_id="hb", epoch=pool.epoch))
    assert beat.epoch == pool.epoch and beat.heartbeat_at_ms >= pool.registered_at_ms
    assert client.stub.DescribePool(pb.DescribePoolRequest(pool_id="hb")).last_heartbeat_ms == beat.heartbeat_at_ms
    again = client.register_pool("hb", num_blocks=8, block_size=4)
    assert again.epoch == pool.epoch + 1 and again.last_heartbeat_ms == 0
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Heartbeat(pb.HeartbeatRequest(pool_id="hb", epoch=pool.epoch))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"is at epoch {again.epoch}, not {pool.epoch}" in info.value.details()
    assert errors.BY_STATUS[info.value.code()] is errors.FailedPrecondition


def test_serve_reads_its_redis_url_from_a_file(redis_url, tmp_path):
    """A URL that carries a password comes from a file (a mounted Secret), not a flag."""
    path = tmp_path / "redis-url"
    path.write_text(redis_url + "\n")
    with AllocatorProcess(env={"KVSERVICE_REDIS_URL_FILE": str(path)}) as proc:
        assert proc.url == redis_url
        with Client(proc.target, keepalive=False) as c:
            c.register_pool("from-file", num_blocks=8, block_size=4)
        assert redis.Redis.from_url(redis_url).exists(keys.pool_key("from-file", "meta"))
    path.write_text("\n")
    out = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--port", "0"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KVSERVICE_REDIS_URL_FILE": str(path)})
    assert out.returncode == 2 and "redis_url_file" in out.stderr and "is empty" in out.stderr
