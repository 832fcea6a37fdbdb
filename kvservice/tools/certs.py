"""``kvservice certs DIR``: a development CA and the certificates signed by it.

Writes, in DIR (keys readable by their owner only):

- ``ca.pem`` / ``ca-key.pem``: the CA (clients trust ``ca.pem``; servers take it as
  their client CA for mTLS);
- ``server.pem`` / ``server-key.pem``: one server certificate for every allocator and
  worker, for ``localhost``, ``127.0.0.1``, ``::1`` and each ``--host`` (it also serves
  as a client certificate for health checks: it names no role);
- ``<name>.pem`` / ``<name>-key.pem`` per ``--client NAME:ROLE``: a client certificate
  whose subject's CN is NAME and O is ROLE (the identity it proves, docs/security.md).

With ``--redis ADDRESS`` it also writes the Redis credentials of a deployment
(``make_redis_users``): ``users.acl`` for ``redis-server --aclfile`` (password digests
only), the allocator's URL ``redis-url`` (``redis://kvservice:<password>@ADDRESS/0``),
an admin's ``redis-admin-url`` and the health user's ``redis-health-password``.

For production, issue certificates from your own CA (cert-manager on Kubernetes:
docs/security.md); these are throwaway credentials for local stacks and tests.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvservice.common.auth import check_identity

#: How long the development certificates are valid.
VALIDITY = datetime.timedelta(days=365)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _save(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    _write(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(directory / f"{stem}-key.pem", key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()), private=True)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certs(directory: str, hosts: Iterable[str] = (), clients: Iterable[tuple[str, str]] = (), *,
               keep: bool = False) -> list[str]:
    """Writes the CA, the server certificate and the client certificates; returns the
    files written.

    Args:
        directory: where (made if missing).
        hosts: more names or addresses of the servers (beyond localhost and loopback).
        clients: (name, role) of each client certificate.
        keep: if the directory holds a CA already, write nothing (a deployment's one-shot
            certificate job, run again, keeps the credentials its servers use).

    Raises:
        ValueError: a client name or role that is not an identity.
    """
    clients = list(clients)
    for name, role in clients:
        check_identity(name, role)
        if name in ("ca", "server"):
            raise ValueError(f"a client may not be named {name!r} (its files would replace the {name}'s)")
    out = Path(directory)
    if keep and (out / "ca.pem").exists():
        return []
    out.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvservice development CA")])
    ca = (_builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _save(out, "ca", ca, ca_key)
    written = ["ca.pem", "ca-key.pem"]

    names = list(dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]))
    key = _key()
    server = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), ca_name, key.public_key())
              .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
              # (also a client certificate: a server's own health check presents it; it names
              # no role, so it opens only the public health and reflection services)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
    _save(out, "server", server, key)
    written += ["server.pem", "server-key.pem"]

    for name, role in clients:
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                             x509.NameAttribute(NameOID.ORGANIZATION_NAME, role)])
        cert = (_builder(subject, ca_name, key.public_key())
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        _save(out, name, cert, key)
        written += [f"{name}.pem", f"{name}-key.pem"]
    return written


def make_redis_users(directory: str, address: str) -> list[str]:
    """Writes a Redis ACL file and the URLs and password of its users for a Redis at
    ``address`` (``host:port``); returns the files written."""
    import secrets

    from kvservice.allocator.embedded import ACL_USERS, ADMIN_USER, ALLOCATOR_USER, HEALTH_USER, acl_file

    passwords = {user: secrets.token_urlsafe(24) for user in ACL_USERS}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    # (Redis reads the ACL file as its own user: readable, and it holds digests only)
    _write(out / "users.acl", acl_file(passwords).encode(), private=False)
    _write(out / "redis-url", f"redis://{ALLOCATOR_USER}:{passwords[ALLOCATOR_USER]}@{address}/0\n".encode(),
           private=True)
    _write(out / "redis-admin-url", f"redis://{ADMIN_USER}:{passwords[ADMIN_USER]}@{address}/0\n".encode(),
           private=True)
    _write(out / "redis-health-password", f"{passwords[HEALTH_USER]}\n".encode(), private=True)
    return ["users.acl", "redis-url", "redis-admin-url", "redis-health-password"]


def parse_client(text: str) -> tuple[str, str]:
    """``NAME:ROLE`` -> (name, role); raises ValueError."""
    name, sep, role = text.partition(":")
    if not sep:
        raise ValueError(f"--client {text!r}: expected NAME:ROLE (e.g. acme:tenant, pool-0:worker)")
    check_identity(name, role)
    return name, role
