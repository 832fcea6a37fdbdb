#!/usr/bin/env bash
# make compose-check: the compose deployment built and run for real, end to end.
#
# On a machine with root (Debian or Ubuntu) and no Docker, or with a running Docker daemon:
#   1. Docker: a running daemon is used; else Debian's docker.io is installed (apt) and its
#      dockerd started here with its defaults (overlay2, bridge networking, iptables).
#   2. Compose v2: `docker compose` or a v2 `docker-compose`; else Debian's docker-compose
#      package (v2, from Debian 13 "trixie": its InRelease checked with the machine's
#      Debian archive keyring, then the Packages index's SHA-256 of the .deb).
#   3. Base images: each registry image (python:3.11-slim, redis:7.2, prom/prometheus,
#      grafana/grafana) is pulled; one that cannot be is replaced by a stand-in built here:
#      Python from `debootstrap --variant=minbase bookworm` + `docker import` (with this
#      machine's CA certificates), Redis by Valkey 8.1, Prometheus by Debian's package
#      (deploy/docker/standin/). Grafana has no stand-in: without its image it is left out
#      and its dashboard's queries are run against Prometheus instead.
#   4. torch: the CPU worker's image takes torch from TORCH_INDEX_URL, or, when that is
#      unreachable, from the wheel pip finds on this machine (copied to deploy/docker/wheels/).
#   5. The `cpu` profile: built, brought up, every service healthy; `kvservice health` of
#      the allocator and both workers and `kvservice audit` inside the network; a chat
#      completion through the API with the generated key; Prometheus's targets all up;
#      every dashboard query answered; Grafana's password made by the certs job; nothing
#      published beyond KVS_BIND (default loopback).
#   6. A worker killed (`docker kill`) while chats run: they all complete on the other
#      worker, the dead pool's sequences are dropped, the audit is clean; the worker,
#      started again, registers with a new epoch and serves.
#   7. The `cluster` profile: six Redis Cluster nodes formed by the init job, the second
#      allocator over them healthy, the audit over the cluster clean.
#   8. Teardown: `down -v`, the images built here removed (KVS_CHECK_KEEP_IMAGES=1 keeps
#      them), the daemon stopped by its pid if this script started it, the copied wheel
#      removed. Packages it installed stay installed (it says which).
# It prints a table of the stages (seconds, result) and exits 1 if any failed.
#
# Variables: KVS_CHECK_PROJECT (compose project name, default kvscheck: a user's own
# `kvservice` project is left alone), KVS_CHECK_KEEP_IMAGES, KVS_BIND, TORCH_INDEX_URL,
# DISK_TIER_GB (each worker's disk tier, default 1 here). When the services do not come up,
# it prints why: each one's state, restarts and OOM kill, its last health probes and logs,
# the memory and disk left.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT=${KVS_CHECK_PROJECT:-kvscheck}
WORK=$(mktemp -d /tmp/kvs-compose-check.XXXXXX)
PROBE=(python3 "$ROOT/scripts/compose_probe.py")
STANDIN=kvservice-standin
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
export TORCH_INDEX_URL
# Each worker preallocates its disk tier: 1 GB here rather than the deployment's 4, so that
# the check fits beside the images on a machine with little free disk.
export DISK_TIER_GB=${DISK_TIER_GB:-1}
STARTED_DOCKERD="" INSTALLED="" COPIED_WHEEL="" NO_GRAFANA=""
COMPOSE=()
TABLE=()
FAILED=0

log() { printf '%s  %s\n' "$(date +%H:%M:%S)" "$*"; }

# stage NAME FUNCTION: runs it, times it, records ok / FAILED; after a failure the later
# stages are skipped (the teardown always runs).
stage() {
  local name=$1 fn=$2 start end result
  if [ "$FAILED" != 0 ]; then
    TABLE+=("$name|-|skipped")
    return
  fi
  log "== $name"
  start=$(date +%s)
  if "$fn"; then result=ok; else result=FAILED; FAILED=1; fi
  end=$(date +%s)
  TABLE+=("$name|$((end - start))|$result")
  log "== $name: $result ($((end - start)) s)"
}

compose() { "${COMPOSE[@]}" -p "$PROJECT" "$@"; }

# ---------------------------------------------------------------- 1. Docker

docker_engine() {
  if docker info >/dev/null 2>&1; then
    log "a Docker daemon runs already: $(docker version --format '{{.Server.Version}}')"
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    log "no Docker daemon runs and this is not root: cannot start one"
    return 1
  fi
  if ! command -v dockerd >/dev/null 2>&1; then
    log "installing Debian's docker.io"
    timeout 300 apt-get update -qq || return 1
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq docker.io >/dev/null || return 1
    INSTALLED="$INSTALLED docker.io"
  fi
  dockerd --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then
      log "dockerd $(docker version --format '{{.Server.Version}}') started (pid $STARTED_DOCKERD," \
          "storage $(docker info --format '{{.Driver}}'))"
      return 0
    fi
    sleep 1
  done
  tail -n 20 "$WORK/dockerd.log"
  return 1
}

# ---------------------------------------------------------------- 2. compose v2

install_debian_compose() {
  local arch base deb sha release_sha
  arch=$(dpkg --print-architecture) || return 1
  base=http://deb.debian.org/debian
  curl -fsS -m 60 "$base/dists/trixie/InRelease" -o "$WORK/InRelease" || return 1
  gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg "$WORK/InRelease" 2>/dev/null || {
    log "trixie's InRelease does not verify against this machine's Debian archive keyring"; return 1; }
  curl -fsS -m 120 "$base/dists/trixie/main/binary-$arch/Packages.xz" -o "$WORK/Packages.xz" || return 1
  release_sha=$(awk -v f="main/binary-$arch/Packages.xz" '/^SHA256:/{s=1; next} /^[A-Za-z]/{s=0} s && $3 == f {print $1}' \
                "$WORK/InRelease")
  echo "$release_sha  $WORK/Packages.xz" | sha256sum -c --quiet - || return 1
  xz -dc "$WORK/Packages.xz" | awk '/^Package: docker-compose$/{p=1} p && /^(Filename|SHA256):/{print $2} p && /^$/{exit}' \
    > "$WORK/compose.pkg"
  deb=$(sed -n 1p "$WORK/compose.pkg"); sha=$(sed -n 2p "$WORK/compose.pkg")
  [ -n "$deb" ] && [ -n "$sha" ] || { log "no docker-compose in trixie's index"; return 1; }
  curl -fsS -m 300 "$base/$deb" -o "$WORK/docker-compose.deb" || return 1
  echo "$sha  $WORK/docker-compose.deb" | sha256sum -c --quiet - || return 1
  dpkg -i "$WORK/docker-compose.deb" >/dev/null || return 1
  INSTALLED="$INSTALLED docker-compose($(basename "$deb"))"
  log "installed $(basename "$deb") from Debian's archive"
}

compose_v2() {
  if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
  elif docker-compose version 2>/dev/null | grep -q 'v2\.'; then
    COMPOSE=(docker-compose)
  elif [ "$(id -u)" = 0 ] && command -v dpkg >/dev/null 2>&1; then
    install_debian_compose || return 1
    if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
  else
    log "no compose v2 and no way to install one"
    return 1
  fi
  log "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null))"
}

# ---------------------------------------------------------------- 3. base images

have_image() {   # pulled already, or pullable now
  docker image inspect "$1" >/dev/null 2>&1 && return 0
  timeout 120 docker pull -q "$1" >/dev/null 2>&1
}

python_standin() {
  local rootfs=$WORK/rootfs
  command -v debootstrap >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq debootstrap >/dev/null || return 1
    INSTALLED="$INSTALLED debootstrap"; }
  log "debootstrap --variant=minbase bookworm (Python 3.11, venv, CA certificates)"
  timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
    bookworm "$rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || { tail -n 20 "$WORK/debootstrap.log"; return 1; }
  # This machine's extra CA certificates (a proxy's, say), so that pip in the builds trusts
  # what this machine trusts.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1 || return 1
  fi
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$STANDIN/python:3.11-bookworm" >/dev/null || return 1
  rm -rf "$rootfs"
}

base_images() {
  if have_image python:3.11-slim; then
    export PYTHON_IMAGE=python:3.11-slim
  else
    log "python:3.11-slim cannot be pulled: a stand-in (debootstrap) takes its place"
    docker image inspect "$STANDIN/python:3.11-bookworm" >/dev/null 2>&1 || python_standin || return 1
    export PYTHON_IMAGE=$STANDIN/python:3.11-bookworm
  fi
  if have_image redis:7.2; then
    export REDIS_IMAGE=redis:7.2
  else
    log "redis:7.2 cannot be pulled: Valkey 8.1 stands in"
    docker build -q -t "$STANDIN/valkey:8.1" --build-arg "BASE_IMAGE=$PYTHON_IMAGE" \
      -f deploy/docker/standin/redis.Dockerfile deploy/docker/standin >/dev/null 2>>"$WORK/standin.log" || { cat "$WORK/standin.log"; return 1; }
    export REDIS_IMAGE=$STANDIN/valkey:8.1
  fi
  if have_image prom/prometheus:v2.53.1; then
    export PROMETHEUS_IMAGE=prom/prometheus:v2.53.1
  else
    log "prom/prometheus:v2.53.1 cannot be pulled: Debian's prometheus stands in"
    docker build -q -t "$STANDIN/prometheus:debian" --build-arg "BASE_IMAGE=$PYTHON_IMAGE" \
      -f deploy/docker/standin/prometheus.Dockerfile deploy/docker/standin >/dev/null 2>>"$WORK/standin.log" || { cat "$WORK/standin.log"; return 1; }
    export PROMETHEUS_IMAGE=$STANDIN/prometheus:debian
  fi
  if ! have_image grafana/grafana:11.1.0; then
    log "grafana/grafana:11.1.0 cannot be pulled and has no stand-in: Grafana is left out"
    NO_GRAFANA=1
  fi
  log "PYTHON_IMAGE=$PYTHON_IMAGE REDIS_IMAGE=$REDIS_IMAGE PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE"
}

# ---------------------------------------------------------------- 4. torch, 5. build

torch_source() {
  if curl -fsS -m 20 -o /dev/null "$TORCH_INDEX_URL/torch/"; then
    log "torch from $TORCH_INDEX_URL"
    return 0
  fi
  if ls deploy/docker/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then
    log "torch from $(ls deploy/docker/wheels/torch-2.13.0*.whl)"
    return 0
  fi
  log "$TORCH_INDEX_URL is unreachable: the torch wheel pip finds here goes into deploy/docker/wheels/"
  python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 -d deploy/docker/wheels torch==2.13.0 || return 1
  COPIED_WHEEL=$(ls deploy/docker/wheels/torch-2.13.0*.whl)
  log "copied $COPIED_WHEEL"
}

build() {
  compose --profile cpu --profile cluster build --progress plain >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log"; return 1; }
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^(kvservice|$STANDIN)/"
}

# ---------------------------------------------------------------- helpers

# The services of the profiles given, less Grafana when it has no image.
services_of() {
  compose "$@" config --services | { if [ -n "$NO_GRAFANA" ]; then grep -vx grafana; else cat; fi; }
}

# wait_healthy SECONDS SERVICE...: each long-running service healthy, each one-shot job
# exited 0.
wait_healthy() {
  local limit=$1; shift
  local deadline=$(($(date +%s) + limit)) pending svc id state
  while :; do
    pending=""
    for svc in "$@"; do
      id=$(compose ps -a -q "$svc" | head -n 1)
      [ -n "$id" ] || { pending="$pending $svc(none)"; continue; }
      # (a one-shot job of an image with a HEALTHCHECK exits "unhealthy": its exit code counts)
      state=$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")
      case $state in
        "running 0 healthy") ;;
        "exited 0"*) ;;
        "exited "*|"dead "*) log "$svc exited: $state"; compose logs --tail 30 "$svc"; return 1 ;;
        *) pending="$pending $svc($state)" ;;
      esac
    done
    [ -z "$pending" ] && return 0
    if [ "$(date +%s)" -gt "$deadline" ]; then
      log "not healthy after $limit s:$pending"
      for svc in $pending; do compose logs --tail 20 "${svc%%(*}"; done
      return 1
    fi
    sleep 3
  done
}

# room: the memory and the disk (Docker's root) the services start with.
room() {
  local root
  root=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
  log "memory available: $(awk '/^MemAvailable:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo); free in $root:" \
      "$(df -Ph "$root" | awk 'NR == 2 {print $4}') (the disk tiers take ${DISK_TIER_GB} GB per worker)"
}

# explain SERVICE...: why `up` failed: each service's state, the last health probes of one
# that is not healthy (their output) and the tail of its logs, its restarts and OOM kill.
explain() {
  local svc id state
  for svc in "$@"; do
    id=$(compose ps -a -q "$svc" | head -n 1)
    [ -n "$id" ] || { log "$svc: no container"; continue; }
    state=$(docker inspect --format '{{.State.Status}} exit={{.State.ExitCode}} oom={{.State.OOMKilled}} restarts={{.RestartCount}} started={{.State.StartedAt}}{{if .State.Health}} health={{.State.Health.Status}}{{end}}' "$id")
    log "$svc: $state"
    case $state in
      "running "*"health=healthy"|"exited exit=0 "*) continue ;;
    esac
    docker inspect --format '{{if .State.Health}}{{range .State.Health.Log}}  probe {{.Start}} exit {{.ExitCode}}: {{.Output}}{{"\n"}}{{end}}{{end}}' "$id"
    compose logs --no-color --timestamps --tail 40 "$svc"
  done
  room
}

in_allocator() { compose exec -T allocator "$@"; }

# audit SERVICE [SED]: kvservice audit in an allocator's container, on the Redis of the
# certs job's redis-url (edited by SED: the cluster allocator's node).
audit() {
  compose exec -T "$1" sh -c "KVSERVICE_REDIS_URL=\$(sed '${2:-}' /certs/redis-url) kvservice audit"
}

api_key() { in_allocator cat /certs/api-key >"$WORK/api-key" && chmod 600 "$WORK/api-key"; }

# ---------------------------------------------------------------- 6. the cpu profile

# ports_free PORT...: each published port free on KVS_BIND (another program holding one
# would make `up` fail half way); says which is taken.
ports_free() {
  python3 - "${KVS_BIND:-127.0.0.1}" "$@" <<'PY'
import socket, sys
host, taken = sys.argv[1], []
for port in map(int, sys.argv[2:]):
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            taken.append(f"{port} ({exc.strerror})")
if taken:
    print(f"ports taken on {host}: {', '.join(taken)}: stop what holds them, or set KVS_BIND")
sys.exit(1 if taken else 0)
PY
}

up_cpu() {
  ports_free 6379 50051 9400 50061 50062 8000 9090 3000 50052 9402 || return 1
  mapfile -t CPU_SERVICES < <(services_of --profile cpu)
  log "services: ${CPU_SERVICES[*]}"
  room
  compose --profile cpu up -d "${CPU_SERVICES[@]}" >"$WORK/up.log" 2>&1 || {
    cat "$WORK/up.log"; explain "${CPU_SERVICES[@]}"; return 1; }
  wait_healthy 600 "${CPU_SERVICES[@]}"
}

# Both API replicas answered chat completions (their access logs, one container each).
replicas_answered() {
  local n
  n=$(compose logs api-cpu 2>/dev/null | grep 'POST /v1/chat/completions' | sed -E 's/^([^ |]+).*/\1/' | sort -u | wc -l)
  [ "$n" -ge 2 ] || { log "chat completions reached $n API replica(s), not 2"; return 1; }
  log "both API replicas answered chat completions"
}

check_cpu() {
  local ok=0 bind
  in_allocator kvservice health --target allocator:50051 || ok=1
  for w in worker-0:50061 worker-1:50062; do in_allocator kvservice health --target "$w" || ok=1; done
  audit allocator || ok=1
  api_key || return 1
  log "a chat completion through the API (key from the certs job)"
  "${PROBE[@]}" chat http://127.0.0.1:8000 "$WORK/api-key" --requests 1 --max-tokens 16 || ok=1
  log "one new prompt to both API replicas at once (the front alternates): answers equal"
  local nonce
  nonce=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
  "${PROBE[@]}" chat http://127.0.0.1:8000 "$WORK/api-key" --requests 2 --max-tokens 24 \
    --question "Ticket $nonce: the blue kettle ships from Oslo and costs 41 crowns. Where does the blue kettle ship from?" \
    || ok=1
  replicas_answered || ok=1
  log "Prometheus's targets (the allocator, two workers, two API replicas)"
  "${PROBE[@]}" targets http://127.0.0.1:9090 --expect 5 --wait 120 || ok=1
  log "the dashboard's queries"
  "${PROBE[@]}" queries http://127.0.0.1:9090 deploy/grafana/dashboards/kvservice.json || ok=1
  log "Grafana's admin password (made by the certs job) and no anonymous access"
  in_allocator sh -c 'test -s /certs/grafana-admin-password' || { log "no /certs/grafana-admin-password"; ok=1; }
  compose config | grep -q 'GF_AUTH_ANONYMOUS_ENABLED: "false"' || { log "Grafana allows anonymous access"; ok=1; }
  if [ -z "$NO_GRAFANA" ]; then
    local status
    status=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:3000/api/dashboards/home)
    [ "$status" = 401 ] || { log "Grafana answered $status without a password"; ok=1; }
    curl -fsS -o /dev/null -u "admin:$(in_allocator cat /certs/grafana-admin-password)" \
      http://127.0.0.1:3000/api/dashboards/home || { log "Grafana refused its generated password"; ok=1; }
  fi
  log "published ports"
  bind=${KVS_BIND:-127.0.0.1}
  docker ps --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Names}} {{.Ports}}' | tee "$WORK/ports"
  grep -oE '(\[[0-9a-f:]*\]|[0-9.]+):[0-9]+->' "$WORK/ports" | sed -E 's/:[0-9]+->$//' | sort -u >"$WORK/bound"
  if [ "$(cat "$WORK/bound")" != "$bind" ]; then
    log "ports published on $(tr '\n' ' ' <"$WORK/bound")beyond KVS_BIND=$bind"; ok=1
  fi
  return $ok
}

# ---------------------------------------------------------------- 7. a worker killed

pool_epoch() {   # the allocator's epoch of a pool, through Prometheus
  "${PROBE[@]}" metric http://127.0.0.1:9090 "max(kvservice_pool_epoch{pool=\"$1\"})"
}

# worker_tokens: the tokens worker-cpu-1 has computed (its Forward counter, read inside
# its container: the workers publish no port).
worker_tokens() {
  compose exec -T worker-cpu-1 python3 -c 'import urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9401/metrics", timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("kvservice_worker_forward_tokens_total"))))'
}

kill_worker() {
  local before after chats failed_steps base now why=()
  before=$(pool_epoch worker-1)
  base=$(worker_tokens) || base=""
  log "worker-1 at epoch ${before:-?}, ${base:-?} tokens computed; 8 chats, then docker kill of worker-cpu-1 once it computes theirs"
  "${PROBE[@]}" chat http://127.0.0.1:8000 "$WORK/api-key" --requests 8 --max-tokens 48 --stagger 0.2 \
    >"$WORK/chats.log" 2>&1 &
  chats=$!
  for _ in $(seq 100); do
    now=$(worker_tokens) || now=""
    [ -n "$now" ] && [ -n "$base" ] && [ "$now" -gt "$base" ] && break
    sleep 0.2
  done
  log "worker-cpu-1 killed at ${now:-?} tokens computed"
  docker kill "$(compose ps -q worker-cpu-1)" >/dev/null || why+=("docker kill failed")
  wait "$chats" || why+=("a chat during the kill failed")
  cat "$WORK/chats.log"
  failed_steps=$(compose logs api-cpu 2>/dev/null | grep -c 'the worker of pool worker-1 failed a step')
  log "steps the killed worker failed, recomputed on worker-0: $failed_steps"
  [ "$failed_steps" -gt 0 ] || why+=("the kill hit no request")
  audit allocator || why+=("the audit after the kill failed")
  log "worker-cpu-1 started again"
  compose start worker-cpu-1 >/dev/null || return 1
  wait_healthy 300 worker-cpu-1 || return 1
  compose logs worker-cpu-1 | grep -E 'registered at epoch' | tail -n 2
  for _ in $(seq 30); do
    after=$(pool_epoch worker-1)
    [ -n "$after" ] && [ -n "$before" ] && [ "${after%.*}" -gt "${before%.*}" ] && break
    sleep 2
  done
  log "worker-1's epoch: ${before:-?} -> ${after:-?}"
  [ -n "$after" ] && [ -n "$before" ] && [ "${after%.*}" -gt "${before%.*}" ] || why+=("no new epoch for worker-1")
  "${PROBE[@]}" chat http://127.0.0.1:8000 "$WORK/api-key" --requests 4 --max-tokens 16 || why+=("a chat after the restart failed")
  audit allocator || why+=("the last audit failed")
  if [ ${#why[@]} -gt 0 ]; then
    compose logs api-cpu 2>/dev/null | grep -E 'WARNING|ERROR' | tail -n 15
    log "worker killed: $(IFS=';'; echo "${why[*]}")"
    return 1
  fi
}

# ---------------------------------------------------------------- 8. the cluster profile

cluster() {
  local svcs
  mapfile -t svcs < <(services_of --profile cluster)
  compose --profile cluster up -d "${svcs[@]}" >"$WORK/up-cluster.log" 2>&1 || {
    cat "$WORK/up-cluster.log"; explain "${svcs[@]}"; return 1; }
  wait_healthy 300 "${svcs[@]}" || return 1
  compose logs redis-cluster-init | tail -n 3
  compose exec -T allocator-cluster kvservice health --target 127.0.0.1:50052 || return 1
  audit allocator-cluster 's#@redis:6379/#@redis-node-0:6379/#'
}

# ---------------------------------------------------------------- teardown

teardown() {
  local ok=0 images
  if [ ${#COMPOSE[@]} -gt 0 ] && docker info >/dev/null 2>&1; then
    compose --profile cpu --profile cluster --profile gpu down -v --remove-orphans >"$WORK/down.log" 2>&1 \
      || { cat "$WORK/down.log"; ok=1; }
    if [ -z "${KVS_CHECK_KEEP_IMAGES:-}" ]; then
      images=$(docker image ls --format '{{.Repository}}:{{.Tag}}' | grep -E "^(kvservice|$STANDIN)/")
      [ -z "$images" ] || docker image rm $images >/dev/null || ok=1
      docker image prune -f >/dev/null
      docker builder prune -f >/dev/null 2>&1
    fi
  fi
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    if kill -0 "$STARTED_DOCKERD" 2>/dev/null; then log "dockerd (pid $STARTED_DOCKERD) did not stop"; ok=1; fi
  fi
  [ -z "$COPIED_WHEEL" ] || rm -f "$COPIED_WHEEL"
  [ -z "$INSTALLED" ] || log "installed by this check and left installed:$INSTALLED"
  return $ok
}

stage "docker engine" docker_engine
stage "compose v2" compose_v2
stage "base images" base_images
stage "torch source" torch_source
stage "build images" build
stage "cpu profile up" up_cpu
stage "cpu profile checks" check_cpu
stage "worker killed" kill_worker
stage "cluster profile" cluster
was=$FAILED FAILED=0
stage "teardown" teardown
[ "$was" = 0 ] || FAILED=1

echo
echo "| stage | seconds | result |"
echo "|---|---|---|"
total=0
for row in "${TABLE[@]}"; do
  IFS='|' read -r name secs result <<<"$row"
  echo "| $name | $secs | $result |"
  [ "$secs" = - ] || total=$((total + secs))
done
echo "| total | $total | $([ "$FAILED" = 0 ] && echo ok || echo FAILED) |"
[ -n "$NO_GRAFANA" ] && echo "(Grafana left out: its image cannot be pulled here; its dashboard's queries ran against Prometheus)"
rm -rf "$WORK"
exit "$FAILED"
