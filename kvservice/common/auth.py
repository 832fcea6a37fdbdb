"""Who is calling, and may they make this call (DESIGN §10, docs/security.md).

A caller proves an identity with a bearer token in the call's metadata
(``authorization: Bearer <token>``), looked up in a **tokens file** of hashed tokens, or
with a client certificate that the server's client CA signed (its subject's CN is the
identity, its O the role, as Kubernetes reads client certificates). An identity has one
role:

- ``tenant``: grants leases (under its own name only) and uses their sequences;
- ``worker``: registers and heartbeats the pool whose id is its name, nothing else;
- ``admin``: anything, any lease, any pool; the audit.

The tokens file holds one token per line, ``sha256:<hex digest of the token> <name>
<role>``; ``#`` starts a comment. It never holds a token itself, so a leaked file grants
nothing. The server reads it again when it changes (checked at most once a second), so
tokens are issued and revoked without a restart (``kvservice token add`` / ``revoke``).

One ``AuthInterceptor`` per server enforces its service's table of method -> roles; a
method missing from the table is refused (fail closed). The handler then reads the
caller's identity with ``caller()``.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc

from kvservice import errors
from kvservice.common.interceptor import UnaryInterceptor, abort
from kvservice.common.settings import TENANT_NAME

log = logging.getLogger(__name__)

ROLES = ("tenant", "worker", "admin")
#: An identity's name: a tenant name or (for a worker) a pool id.
NAME = TENANT_NAME
_LINE = re.compile(r"sha256:([0-9a-f]{64})\s+(\S+)\s+(\S+)")
#: Seconds between two looks at the tokens file's modification time.
RELOAD_INTERVAL = 1.0
#: The prefix of tokens that ``new_token`` makes (so that a scanner can find leaked ones).
TOKEN_PREFIX = "kvs_"


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller: its name (a tenant, a worker's pool id, an admin) and role."""

    name: str
    role: str

    def __str__(self) -> str:
        return f"{self.role} {self.name}"


_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvservice_caller", default=None)


def caller() -> Identity | None:
    """The identity of the call being handled; None when the server authenticates nobody."""
    return _caller.get()


def hash_token(token: str) -> str:
    """A token as the tokens file stores it: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def check_identity(name: str, role: str) -> None:
    """Raises ValueError unless ``name`` and ``role`` make an identity."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    if not NAME.fullmatch(name):
        raise ValueError(f"malformed identity name {name!r} (letters, digits, _ . @ -; at most 64)")


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, Identity]:
    """The tokens of a tokens file's text: ``sha256:<hex>`` -> identity.

    Raises:
        ValueError: a malformed line, or a token listed twice (the message names the line).
    """
    out: dict[str, Identity] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise ValueError(f"{source}:{number}: expected 'sha256:<64 hex digits> <name> <role>'")
        digest, name, role = m.groups()
        try:
            check_identity(name, role)
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {exc}") from None
        key = "sha256:" + digest
        if key in out:
            raise ValueError(f"{source}:{number}: this token is listed twice")
        out[key] = Identity(name, role)
    return out


class TokenFile:
    """A tokens file, read again when it changes.

    A change that does not parse is refused with a warning and the previous tokens stay
    in force (a half-written file never locks every caller out).

    Raises:
        ValueError / OSError: on creation, when the file cannot be read or parsed.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._tokens = self._read()
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> dict[str, Identity]:
        with open(self.path, encoding="utf-8") as f:
            return parse_tokens(f.read(), self.path)

    def __len__(self) -> int:
        return len(self._tokens)

    def lookup(self, token: str) -> Identity | None:
        """The identity that ``token`` proves, or None."""
        self._maybe_reload()
        return self._tokens.get(hash_token(token))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_INTERVAL:
            return
        with self._lock:
            if now - self._checked < RELOAD_INTERVAL:
                return
            self._checked = now
            try:
                stamp = self._stat()
                if stamp == self._stamp:
                    return
                tokens = self._read()
            except (OSError, ValueError) as exc:
                log.warning("tokens file %s not reloaded, the previous tokens stay in force: %s", self.path, exc)
                return
            self._stamp, self._tokens = stamp, tokens
            log.info("tokens file %s reloaded: %d tokens", self.path, len(tokens))


def add_token(path: str, name: str, role: str) -> str:
    """Issues a token: appends its hash for ``name`` / ``role`` to the tokens file (made,
    readable by its owner only, if missing) and returns the token, which is stored nowhere.

    Raises:
        ValueError: a malformed name or role.
    """
    check_identity(name, role)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(f"{hash_token(token)} {name} {role}\n")
    return token


def revoke_tokens(path: str, name: str) -> int:
    """Removes every token of ``name`` from the tokens file (atomically); returns how many."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    kept, dropped = [], 0
    for line in lines:
        m = _LINE.fullmatch(line.split("#", 1)[0].strip())
        if m is not None and m.group(2) == name:
            dropped += 1
        else:
            kept.append(line)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return dropped


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry of call metadata, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""
    return None


class AuthInterceptor(UnaryInterceptor):
    """Authenticates every call of the services in ``table`` and checks its role.

    Args:
        table: full method name (``/kvservice.v1.Allocator/Step``) -> the roles that may
            call it. A method of a service named in the table but missing from it is
            refused; methods of other services (health, reflection) are public.
        tokens: the tokens file, or None (certificates only).
        certificates: whether a verified client certificate proves an identity.
    """

    def __init__(self, table: Mapping[str, frozenset[str]], tokens: TokenFile | None,
                 certificates: bool = False) -> None:
        self.table = dict(table)
        self.services = {m.rsplit("/", 1)[0] for m in self.table}
        self.tokens = tokens
        self.certificates = certificates

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.rsplit("/", 1)[0] not in self.services:
            return await continuation(handler_call_details)
        return await super().intercept_service(continuation, handler_call_details)

    def identify(self, context: grpc.aio.ServicerContext) -> Identity:
        """The caller's identity; raises Unauthenticated."""
        token = bearer_token(context.invocation_metadata())
        if token is not None:
            if not token or self.tokens is None:
                raise errors.Unauthenticated("the call's bearer token is malformed or this server takes no tokens")
            ident = self.tokens.lookup(token)
            if ident is None:
                raise errors.Unauthenticated("unknown bearer token (never issued, or revoked)")
            return ident
        if self.certificates:
            ident = certificate_identity(context.auth_context())
            if ident is not None:
                return ident
        raise errors.Unauthenticated("the call carries no credentials: send 'authorization: Bearer <token>' "
                                     "metadata" + (" or a client certificate" if self.certificates else ""))

    def check(self, context: grpc.aio.ServicerContext, method: str) -> Identity:
        """The caller's identity once its role may call ``method``; raises Unauthenticated
        or PermissionDenied."""
        roles = self.table.get(method, frozenset())
        ident = self.identify(context)
        if ident.role not in roles:
            allowed = ", ".join(r for r in ROLES if r in roles) or "none"
            raise errors.PermissionDenied(f"{method.rsplit('/', 1)[-1]} is not open to the {ident.role} role "
                                          f"(caller {ident.name}; allowed: {allowed})")
        return ident

    async def admit(self, context: grpc.aio.ServicerContext, method: str) -> contextvars.Token:
        """Makes the caller, once ``check`` admits it, the one ``caller()`` names (reset
        with the token returned); aborts the call otherwise."""
        try:
            return _caller.set(self.check(context, method))
        except errors.KvsError as exc:
            await abort(context, exc)
            raise

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            reset = await self.admit(context, method)
            try:
                return await inner(request, context)
            finally:
                _caller.reset(reset)

        return guarded

    def wrap_stream(self, inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            reset = await self.admit(context, method)
            try:
                async for message in inner(request, context):
                    yield message
            finally:
                _caller.reset(reset)

        return guarded


def certificate_identity(auth_context: Mapping[str, list[bytes]]) -> Identity | None:
    """The identity of a verified client certificate: its subject's CN and O (the role),
    or None when there is no certificate or it names no valid identity."""
    pem = (auth_context or {}).get("x509_pem_cert")
    if not pem:
        return None
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem[0])
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    org = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    if len(cn) != 1 or len(org) != 1:
        return None
    name, role = str(cn[0].value), str(org[0].value)
    try:
        check_identity(name, role)
    except ValueError:
        return None
    return Identity(name, role)
