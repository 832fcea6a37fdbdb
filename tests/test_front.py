"""The round-robin front of ``kvservice up --api-replicas N`` (kvservice/api/front.py) over
real HTTP servers: connections alternate between the replicas, bodies of any size and
streamed answers pass through unchanged, a replica that is down is skipped, and with
every replica down the client's connection is closed (no answer, no hang)."""

from __future__ import annotations

import http.client
import http.server
import socket
import threading

import pytest

from kvservice.api.front import RoundRobinFront


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out = self.server.name.encode() + b":" + body            # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:                                   # a streamed answer, chunk by chunk
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(5):
            data = f"data: {i}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def replicas():
    servers = []
    for name in ("r0", "r1"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.name = name
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _post(port: int, body: bytes) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body=body)
        return conn.getresponse().read()
    finally:
        conn.close()


def test_connections_alternate_and_bodies_pass_unchanged(replicas):
    front = RoundRobinFront("127.0.0.1", 0, [f"127.0.0.1:{s.server_address[1]}" for s in replicas]).start()
    try:
        big = bytes(range(256)) * 4096                          # 1 MiB
        answers = [_post(front.port, big) for _ in range(4)]
        assert [a.split(b":", 1)[0] for a in answers] == [b"r0", b"r1", b"r0", b"r1"]
        assert all(a.split(b":", 1)[1] == big for a in answers)
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
        conn.request("GET", "/stream")
        assert conn.getresponse().read() == b"".join(f"data: {i}\n\n".encode() for i in range(5))
        conn.close()
        r0, r1 = (f"127.0.0.1:{s.server_address[1]}" for s in replicas)
        assert front.connections == {r0: 3, r1: 2}
    finally:
        front.stop()


def test_a_replica_that_is_down_is_skipped_and_none_up_closes_the_connection(replicas):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]                               # (nothing listens there once closed)
    live = replicas[1].server_address[1]
    front = RoundRobinFront("127.0.0.1", 0, [f"127.0.0.1:{dead}", f"127.0.0.1:{live}"]).start()
    try:
        assert [_post(front.port, b"x") for _ in range(3)] == [b"r1:x"] * 3
        assert front.connections == {f"127.0.0.1:{live}": 3}
    finally:
        front.stop()
    nobody = RoundRobinFront("127.0.0.1", 0, [f"127.0.0.1:{dead}"]).start()
    try:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            _post(nobody.port, b"x")
    finally:
        nobody.stop()


def test_a_name_with_several_addresses_is_several_replicas(replicas):
    # ("localhost" may resolve to ::1 too: a replica bound to 127.0.0.1 only refuses there,
    # and is skipped; every answer still comes, alternating over the addresses that listen)
    port = replicas[0].server_address[1]
    front = RoundRobinFront("127.0.0.1", 0, [f"localhost:{port}"]).start()
    try:
        assert [_post(front.port, b"y") for _ in range(3)] == [b"r0:y"] * 3
        assert front.connections[f"127.0.0.1:{port}"] == 3
    finally:
        front.stop()


def test_a_front_needs_a_backend_and_a_free_port():
    with pytest.raises(ValueError, match="at least one backend"):
        RoundRobinFront("127.0.0.1", 0, [])
    with pytest.raises(ValueError, match="host:port"):
        RoundRobinFront("127.0.0.1", 0, ["api"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="could not listen"):
            RoundRobinFront("127.0.0.1", s.getsockname()[1], ["127.0.0.1:1"]).start()


def test_garbage_and_abandoned_connections_leave_the_front_serving(replicas):
    # (the front parses nothing: a malformed request reaches a replica, which refuses it;
    # a client that connects and says nothing, or goes away mid-request, costs the others
    # nothing)
    front = RoundRobinFront("127.0.0.1", 0, [f"127.0.0.1:{replicas[0].server_address[1]}"]).start()
    try:
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
            s.sendall(b"\x00\xff NOT HTTP \r\n\r\n")
            answer = s.recv(4096)
            assert b"400 - Bad request" in answer          # (the replica's refusal, passed back)
        idle = socket.create_connection(("127.0.0.1", front.port), timeout=10)
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\nhalf")
        assert _post(front.port, b"z") == b"r0:z"
        idle.close()
    finally:
        front.stop()
