"""The allocator over ``rediss://``: TLS to a real Redis (the ``redis-server`` on PATH,
built with TLS), its CA and client certificate given in the URL's query, an ACL user's
password in the URL; plaintext to the TLS port, and TLS without the CA, fail."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.parse

import pytest
import redis

from helpers import TEST_SETTINGS, ServerThread, audit
from kvservice.client import Client
from kvservice.tools.certs import make_certs

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_redis(tmp_path):
    binary = shutil.which("redis-server")
    assert binary, "no redis-server on PATH (the 'path' Redis flavour of the suite)"
    make_certs(str(tmp_path), clients=[("allocator", "worker")])
    port = _free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text("\n".join([
        "port 0", f"tls-port {port}", "bind 127.0.0.1", f"dir {tmp_path}", "save \"\"", "appendonly no",
        f"tls-cert-file {tmp_path / 'server.pem'}", f"tls-key-file {tmp_path / 'server-key.pem'}",
        f"tls-ca-cert-file {tmp_path / 'ca.pem'}", "tls-auth-clients yes",
        "user default off", "user kvs on >s3cret ~kvs:* +@all", ""]))
    proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    q = urllib.parse.urlencode({"ssl_ca_certs": tmp_path / "ca.pem", "ssl_certfile": tmp_path / "allocator.pem",
                                "ssl_keyfile": tmp_path / "allocator-key.pem", "ssl_cert_reqs": "required"})
    url = f"rediss://kvs:s3cret@127.0.0.1:{port}/0?{q}"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the TLS Redis did not start"
            time.sleep(0.05)
    yield url, port, tmp_path
    proc.terminate()
    proc.wait(10)


def test_the_allocator_works_over_rediss(tls_redis):
    url, port, _ = tls_redis
    with ServerThread(url, TEST_SETTINGS) as server, Client(server.target, tenant="t1") as c:
        c.register_pool("p0", num_blocks=64, block_size=4)
        s = c.create(list(range(10)), pool="p0")
        s.append([1, 2, 3])
        assert c.get(s.id).num_tokens == 13
        s.free()
    assert audit(url) == []


def test_plaintext_and_unverified_tls_to_the_tls_port_fail(tls_redis):
    url, port, tmp = tls_redis
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, username="kvs", password="s3cret", socket_timeout=2).ping()
    # TLS without the client certificate (the server asks for one) fails too.
    no_cert = f"rediss://kvs:s3cret@127.0.0.1:{port}/0?" + urllib.parse.urlencode(
        {"ssl_ca_certs": tmp / "ca.pem", "ssl_cert_reqs": "required"})
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(no_cert, socket_timeout=2).ping()
