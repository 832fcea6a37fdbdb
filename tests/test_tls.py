"""TLS on the allocator (docs/security.md): server certificates, mTLS identities from
client certificates, tokens over TLS, and the refusal of plaintext beyond loopback."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from helpers import TEST_SETTINGS, ServerThread, keyspace
from kvservice import errors
from kvservice.allocator.config import Settings
from kvservice.client import Client
from kvservice.common.auth import TokenFile, add_token
from kvservice.common.security import ClientCredentials, ServerTls, is_loopback
from kvservice.tools.certs import make_certs
from kvservice.tools.launcher import AllocatorProcess
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two development CAs: ours (server, acme:tenant, ops:admin) and a stranger's."""
    ours = tmp_path_factory.mktemp("pki")
    make_certs(str(ours), clients=[("acme", "tenant"), ("ops", "admin"), ("pool-a", "worker")])
    other = tmp_path_factory.mktemp("other-pki")
    make_certs(str(other), clients=[("acme", "tenant"), ("ops", "admin")])
    return ours, other


def _creds(directory, name: str | None = None, token: str = "") -> ClientCredentials:
    if name is None:
        return ClientCredentials(token=token, ca=str(directory / "ca.pem"))
    return ClientCredentials(token=token, ca=str(directory / "ca.pem"), cert=str(directory / f"{name}.pem"),
                             key=str(directory / f"{name}-key.pem"))


def _server_tls(directory, mtls: bool) -> ServerTls:
    return ServerTls(str(directory / "server.pem"), str(directory / "server-key.pem"),
                     str(directory / "ca.pem") if mtls else "")


def test_mtls_client_certificates_prove_identities(redis_url, pki):
    ours, _ = pki
    with ServerThread(redis_url, TEST_SETTINGS, tls=_server_tls(ours, mtls=True)) as server:
        with Client(server.target, credentials=_creds(ours, "acme"), local=True) as client:
            assert client.lease.tenant == "acme"
            with pytest.raises(grpc.RpcError) as info:
                client.stub.Audit(pb.AuditRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not open to the tenant role" in info.value.details()
        channel = _creds(ours, "ops").channel(server.target)
        try:
            assert pb_grpc.AllocatorStub(channel).Audit(pb.AuditRequest(), timeout=10).ok
        finally:
            channel.close()


def test_certificates_of_another_ca_and_plaintext_are_refused_with_nothing_changed(redis_url, pki):
    ours, other = pki
    with ServerThread(redis_url, TEST_SETTINGS, reap=False, tls=_server_tls(ours, mtls=True)) as server:
        before = keyspace(redis_url)
        attempts = [
            ("another CA's client certificate", _creds(other, "ops").channel(server.target,
                                                                             [("grpc.ssl_target_name_override",
                                                                               "localhost")])),
            ("no client certificate", _creds(ours).channel(server.target)),
            ("plaintext", grpc.insecure_channel(server.target)),
        ]
        for what, channel in attempts:
            try:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.AllocatorStub(channel).GrantLease(pb.GrantLeaseRequest(ttl_seconds=5), timeout=5)
                # The TLS handshake refuses the connection: no call reaches a handler.
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (what, info.value.code())
            finally:
                channel.close()
        assert keyspace(redis_url) == before


def test_a_certificate_for_the_server_from_another_ca_is_not_trusted(redis_url, pki):
    ours, other = pki
    with ServerThread(redis_url, TEST_SETTINGS, tls=_server_tls(ours, mtls=False)) as server:
        with pytest.raises(errors.Unavailable):
            Client(server.target, credentials=_creds(other), timeout=3, retry_budget=0.5)


def test_tokens_ride_on_tls_as_call_credentials(redis_url, pki, tmp_path):
    ours, _ = pki
    path = str(tmp_path / "tokens")
    token = add_token(path, "globex", "tenant")
    with ServerThread(redis_url, TEST_SETTINGS, tls=_server_tls(ours, mtls=False),
                      tokens=TokenFile(path)) as server:
        with Client(server.target, credentials=_creds(ours, token=token)) as client:
            assert client.lease.tenant == "globex"
        with pytest.raises(errors.Unauthenticated):
            Client(server.target, credentials=_creds(ours))


def test_a_bearer_token_wins_over_the_certificate(redis_url, pki, tmp_path):
    """An engine's certificate says which component it is; a token, which tenant it serves."""
    ours, _ = pki
    path = str(tmp_path / "tokens")
    token = add_token(path, "globex", "tenant")
    with ServerThread(redis_url, TEST_SETTINGS, tls=_server_tls(ours, mtls=True), tokens=TokenFile(path)) as server:
        with Client(server.target, credentials=_creds(ours, "acme", token=token)) as client:
            assert client.lease.tenant == "globex"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("10.1.2.3", False), ("[::]", False)])
def test_loopback_is_told_apart(host, loopback):
    assert is_loopback(host) is loopback


def test_plaintext_beyond_loopback_needs_insecure_in_so_many_words():
    with pytest.raises(ValueError, match="without TLS: give --tls-cert and --tls-key .* or --insecure"):
        Settings(host="0.0.0.0")
    assert Settings(host="0.0.0.0", insecure=True).insecure
    assert Settings(host="0.0.0.0", tls_cert="/c.pem", tls_key="/k.pem").host == "0.0.0.0"
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Settings(tls_cert="/c.pem")
    with pytest.raises(ValueError, match="needs tls_cert and tls_key"):
        Settings(tls_client_ca="/ca.pem")
    assert Settings.from_env({"KVSERVICE_INSECURE": "1", "KVSERVICE_HOST": "0.0.0.0"}).insecure
    with pytest.raises(ValueError, match="is not a boolean"):
        Settings.from_env({"KVSERVICE_INSECURE": "maybe"})


def test_serve_refuses_plaintext_beyond_loopback():
    out = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "without TLS" in out.stderr and "--insecure" in out.stderr


def test_a_tls_allocator_process_answers_health_and_the_sdk(pki, tmp_path):
    ours, _ = pki
    args = ("--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server-key.pem"),
            "--tls-client-ca", str(ours / "ca.pem"))
    with AllocatorProcess(args=args) as proc:
        env = {"KVSERVICE_TLS_CA": str(ours / "ca.pem"), "KVSERVICE_CLIENT_CERT": str(ours / "acme.pem"),
               "KVSERVICE_CLIENT_KEY": str(ours / "acme-key.pem")}
        health = subprocess.run([sys.executable, "-m", "kvservice", "health", "--target", proc.target],
                                capture_output=True, text=True, timeout=60, env={**__import__("os").environ, **env})
        assert health.returncode == 0, health.stderr
        assert "SERVING" in health.stdout
        with Client(proc.target, credentials=ClientCredentials.from_env(env)) as client:
            assert client.lease.tenant == "acme"
