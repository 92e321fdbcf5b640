#!/usr/bin/env bash
# docker-slurm: build, start and drive the container TEST cluster of docker-compose.yml (docs/docker-slurm.md).
# Test and demo only, never a deployment: its compute nodes are privileged containers.
#
#   docker-slurm/cluster.sh CMD...      the commands in the order given:
#     build     base image (debootstrap'ed Debian 12), CRIU binary, the cluster's image
#     up        start the cluster (compose up -d) and wait until both compute nodes are idle
#     demo      scripts/demo.sh in the controller: a job checkpointed, requeued onto the other node, restored
#     status    compose ps and sinfo
#     logs      the last lines of every container's output
#     down      stop the cluster and remove its volumes (and the podman API service this script started)
#     exec SERVICE CMD...   run CMD in a container (the rest of the line), e.g. exec slurmctld sinfo
#
# Engines: Docker (with `docker compose` or docker-compose), or podman as root through its Docker API
# (`podman system service`) and Debian's docker-compose. On Debian, as root, the missing host tools are
# installed with apt-get. Environment:
#   SLURMCKPT_ENGINE=docker|podman        default: Docker when its daemon answers, else podman
#   SLURMCKPT_BASE_IMAGE=IMAGE            base image instead of the debootstrap'ed one (which needs root: as
#                                         a user, the default is docker.io/library/debian:bookworm)
#   DEBIAN_MIRROR=URL                     for debootstrap (default http://deb.debian.org/debian)
set -euo pipefail
umask 022
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
LOG_TAG=docker-slurm
# shellcheck source=scripts/lib.sh
. "$REPO/scripts/lib.sh"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

IMAGE=localhost/slurmckpt/slurm:latest
DEBOOTSTRAP_IMAGE=localhost/slurmckpt/debian:bookworm
BUILD=$HERE/.build                       # build context extras and CRIU built in a container (git-ignored)
PROJECT=docker-slurm
# podman: the containers may not raise nofile/nproc above the host's limits (podman's default does).
ULIMITS=(--ulimit nofile=16384:16384 --ulimit nproc=16384:16384)
PODMAN_SOCK_DIR=/run/docker-slurm
WAIT_NODES_S=${SLURMCKPT_WAIT_NODES_S:-180}

# ------------------------------------------------------------------------------------------------ host tools
# need_tools CMD:PACKAGE...: each CMD on PATH, else its Debian package installed (root) or a clear error.
need_tools() {
  local spec cmd pkg miss=()
  for spec in "$@"; do
    cmd=${spec%%:*} pkg=${spec#*:}
    command -v "$cmd" >/dev/null 2>&1 || miss+=("$pkg")
  done
  [ ${#miss[@]} -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing host tools: ${miss[*]}"
    apt-get update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${miss[@]}" >/dev/null \
      || die "apt-get install ${miss[*]} failed"
  else
    die "missing host tools; install the Debian packages: ${miss[*]}"
  fi
}

# ---------------------------------------------------------------------------------------------------- engine
ENGINE=${SLURMCKPT_ENGINE:-}
COMPOSE=()

engine_init() {
  if [ -z "$ENGINE" ]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
  fi
  case $ENGINE in
    docker)
      if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
      else need_tools docker-compose:docker-compose; COMPOSE=(docker-compose); fi ;;
    podman)
      # rootless podman cannot give CRIU and slurmd the host privileges they need (docs/docker-slurm.md)
      [ "$(id -u)" = 0 ] || die "podman is used as root only here; as a user, use Docker (SLURMCKPT_ENGINE=docker)"
      # runc: crun refuses hybrid cgroup v1 hosts; the dnsname plugin lets containers resolve each other
      need_tools podman:podman runc:runc docker-compose:docker-compose \
        /usr/lib/cni/dnsname:golang-github-containernetworking-plugin-dnsname
      COMPOSE=(docker-compose) ;;
    *) die "SLURMCKPT_ENGINE must be docker or podman (got '$ENGINE')" ;;
  esac
  COMPOSE+=(-p "$PROJECT" -f "$HERE/docker-compose.yml")
}

# The engine's own CLI (build, image, run).
engine() { "$ENGINE" "$@"; }

# compose ARGS...: the compose client, talking to podman's Docker API service when podman is the engine.
compose() {
  if [ "$ENGINE" = podman ]; then podman_service; DOCKER_HOST=unix://$PODMAN_SOCK_DIR/podman.sock "${COMPOSE[@]}" "$@"
  else "${COMPOSE[@]}" "$@"; fi
}

podman_service() {
  local sock=$PODMAN_SOCK_DIR/podman.sock pidf=$PODMAN_SOCK_DIR/podman.pid i
  if [ -S "$sock" ] && curl_ping "$sock"; then return 0; fi
  install -d -m 0700 "$PODMAN_SOCK_DIR"
  rm -f "$sock"
  setsid podman system service --time=0 "unix://$sock" >"$PODMAN_SOCK_DIR/service.log" 2>&1 </dev/null &
  echo $! >"$pidf"
  for ((i = 0; i < 100; i++)); do [ -S "$sock" ] && curl_ping "$sock" && return 0; sleep 0.1; done
  cat "$PODMAN_SOCK_DIR/service.log" >&2
  die "podman system service did not answer on $sock within 10 s"
}

# curl_ping SOCK: the Docker API at SOCK answers /_ping (python: curl is not always installed).
curl_ping() {
  python3 - "$1" <<'EOF' 2>/dev/null
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
sys.exit(0 if s.recv(64).split()[1:2] == [b"200"] else 1)
EOF
}

podman_service_stop() {
  local pidf=$PODMAN_SOCK_DIR/podman.pid pid
  [ -s "$pidf" ] || return 0
  pid=$(<"$pidf")
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = podman ]; then kill "$pid"; fi
  rm -f "$pidf" "$PODMAN_SOCK_DIR/podman.sock"
}

# ----------------------------------------------------------------------------------------------------- build
image_exists() { engine image inspect "$1" >/dev/null 2>&1; }

# rootfs_remove DIR: a debootstrap target that failed half-way may still have /proc, /sys mounted inside.
rootfs_remove() {
  local m
  for m in $(awk -v r="$1/" 'index($5, r) == 1 {print $5}' /proc/self/mountinfo | sort -r); do umount -l "$m"; done
  rm -rf --one-file-system "$1"
}

# base_image: prints the base image to build on, debootstrap'ing it on first use.
base_image() {
  if [ -n "${SLURMCKPT_BASE_IMAGE:-}" ]; then echo "$SLURMCKPT_BASE_IMAGE"; return; fi
  if ! image_exists "$DEBOOTSTRAP_IMAGE"; then
    if [ "$(id -u)" != 0 ]; then
      log "not root: no debootstrap; the base is Debian 12 from the engine's registry (SLURMCKPT_BASE_IMAGE to choose)"
      echo docker.io/library/debian:bookworm; return
    fi
    need_tools debootstrap:debootstrap
    local root t0; root=$(mktemp -d /var/tmp/docker-slurm-rootfs.XXXXXX); t0=$(date +%s)
    log "debootstrap --variant=minbase bookworm (about 30 s)"
    debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
      >"$BUILD/debootstrap.log" 2>&1 || { tail -n 20 "$BUILD/debootstrap.log" >&2; rootfs_remove "$root"; die "debootstrap failed"; }
    cat >"$root/etc/apt/sources.list" <<EOF
deb ${DEBIAN_MIRROR:-http://deb.debian.org/debian} bookworm main
deb ${DEBIAN_MIRROR:-http://deb.debian.org/debian} bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | engine import - "$DEBOOTSTRAP_IMAGE" >/dev/null || { rootfs_remove "$root"; die "image import failed"; }
    rootfs_remove "$root"
    log "base image $DEBOOTSTRAP_IMAGE made in $(( $(date +%s) - t0 )) s"
  fi
  echo "$DEBOOTSTRAP_IMAGE"
}

# criu_binary BASE: puts our patched CRIU at $BUILD/criu: the host's build cache (scripts/setup.sh), else a
# build from an earlier run, else one built now in a container from BASE with setup.sh's criu-build step.
criu_binary() {
  local base=$1 id found="" d
  id=$(criu_patch_id)
  for d in "$SLURMCKPT_CACHE" "$BUILD/cache"; do
    found=$(ls -1d "$d"/criu-*-p"$id"/criu 2>/dev/null | sort -V | tail -n1 || true)
    [ -z "$found" ] || break
  done
  if [ -z "$found" ]; then
    log "no CRIU build of patch set $id cached: building one in a container (a few minutes)"
    install -d "$BUILD/cache"
    engine run --rm "${ULIMITS[@]}" -e SLURMCKPT_PACKAGES=criu-build \
      -v "$REPO/scripts:/src/scripts:ro" -v "$BUILD/cache:/var/cache/slurmckpt" "$base" \
      bash -c "bash /src/scripts/setup.sh packages criu-build && chown -R $(id -u):$(id -g) /var/cache/slurmckpt" \
      >"$BUILD/criu-build.log" 2>&1 || { tail -n 40 "$BUILD/criu-build.log" >&2; die "building CRIU in a container failed (log: $BUILD/criu-build.log)"; }
    found=$(ls -1d "$BUILD/cache"/criu-*-p"$id"/criu 2>/dev/null | sort -V | tail -n1 || true)
    [ -n "$found" ] || die "the CRIU build left no binary in $BUILD/cache"
  fi
  log "CRIU: $found"
  cmp -s "$found" "$BUILD/criu" || install -m 0755 "$found" "$BUILD/criu"
}

cmd_build() {
  local base t0; t0=$(date +%s)
  install -d "$BUILD"
  base=$(base_image)
  criu_binary "$base"
  # the host's locally added CAs (Containerfile)
  rm -rf "$BUILD/ca-certificates"; install -d "$BUILD/ca-certificates"
  if [ -d /usr/local/share/ca-certificates ]; then cp -R /usr/local/share/ca-certificates/. "$BUILD/ca-certificates/"; fi
  local extra=(); [ "$ENGINE" = podman ] && extra=("${ULIMITS[@]}")
  log "building $IMAGE from $base"
  engine build "${extra[@]}" -f "$HERE/Containerfile" --build-arg "BASE=$base" -t "$IMAGE" "$REPO" \
    >"$BUILD/image-build.log" 2>&1 || { tail -n 40 "$BUILD/image-build.log" >&2; die "image build failed (log: $BUILD/image-build.log)"; }
  # layers of earlier builds that no image uses any more (the current image's own layers stay: its cache)
  engine image prune -f --filter label=org.slurmckpt.docker-slurm=1 >/dev/null || warn "image prune failed"
  log "image $IMAGE built in $(( $(date +%s) - t0 )) s"
}

# -------------------------------------------------------------------------------------------------- cluster
in_ctld() { compose exec -T slurmctld "$@"; }

cmd_up() {
  local t0 i states; t0=$(date +%s)
  image_exists "$IMAGE" || die "image $IMAGE missing: run '$0 build' first"
  compose up -d >"$BUILD/up.log" 2>&1 || { cat "$BUILD/up.log" >&2; die "compose up failed"; }
  for ((i = 0; i < WAIT_NODES_S; i++)); do
    states=$(in_ctld sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [[ "$states" =~ c1\ idle ]] && [[ "$states" =~ c2\ idle ]]; then
      log "cluster up in $(( $(date +%s) - t0 )) s: $states"
      log "a TEST cluster: its compute nodes are privileged containers (root in them is root on this host)"
      return 0
    fi
    sleep 1
  done
  cmd_logs >&2
  die "compute nodes c1, c2 not idle after ${WAIT_NODES_S}s (sinfo: ${states:-no answer})"
}

cmd_demo() {
  in_ctld env DEMO_OTHER_NODE=1 bash /opt/slurmckpt/src/scripts/demo.sh
}

cmd_status() { compose ps; in_ctld sinfo 2>/dev/null || log "slurmctld is not running (cluster.sh up)"; }

cmd_logs() { compose logs --tail=40 2>&1; }

cmd_down() {
  compose down -v --remove-orphans >"$BUILD/down.log" 2>&1 || { cat "$BUILD/down.log" >&2; die "compose down failed"; }
  [ "$ENGINE" != podman ] || podman_service_stop
  log "cluster stopped, volumes removed"
}

main() {
  [ $# -gt 0 ] || die "usage: $0 build|up|demo|status|logs|down|exec SERVICE CMD... (several in order)"
  install -d "$BUILD"
  engine_init
  log "engine: $ENGINE, compose: ${COMPOSE[*]:0:1}"
  while [ $# -gt 0 ]; do
    case $1 in
      build) cmd_build ;; up) cmd_up ;; demo) cmd_demo ;; status) cmd_status ;; logs) cmd_logs ;;
      down) cmd_down ;;
      exec) shift; [ $# -ge 2 ] || die "usage: $0 exec SERVICE CMD..."
            if [ -t 0 ] && [ -t 1 ]; then compose exec "$@"; else compose exec -T "$@"; fi; return ;;
      *) die "unknown command '$1' (build up demo status logs down exec)" ;;
    esac
    shift
  done
}

main "$@"
