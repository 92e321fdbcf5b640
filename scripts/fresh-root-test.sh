#!/usr/bin/env bash
# Developer tool: run scripts/setup.sh "from nothing" in a fresh Debian root (debootstrap minbase), as CI would on
# a new machine, without touching the host's own cluster.
#
#   scripts/fresh-root-test.sh [SUITE] [-- COMMAND]    SUITE: bookworm (default) or trixie
#
# Phase 1 (host network, own mount/PID/UTS namespaces): apt, CRIU build, venv, SPANK, config. Phase 2 (also its
# own network namespace, only loopback, so ports 3306/6817-6819 do not clash with the host): COMMAND, default
# `scripts/setup.sh` (the whole set-up incl. cluster + smoke check) followed by `NODES=3 scripts/setup.sh`.
# pip has no network in phase 2: phase 1 downloads the wheels it needs into the root (PIP_NO_INDEX + find-links).
# Every process started inside dies with the PID namespace. The root stays in /var/tmp/slurmckpt-fresh-<suite>
# (delete it to start over). Needs debootstrap (apt-get install debootstrap).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=${1:-bookworm}; shift || true
[ "${1:-}" != -- ] || shift
CMD=${*:-"bash scripts/setup.sh && NODES=3 bash scripts/setup.sh && bash scripts/cluster.sh status"}
ROOT=/var/tmp/slurmckpt-fresh-$SUITE
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install -y debootstrap" >&2; exit 1; }

if [ ! -x "$ROOT/bin/bash" ]; then
  echo "== debootstrap $SUITE -> $ROOT"
  dlog=$(mktemp)
  debootstrap --variant=minbase "$SUITE" "$ROOT" http://deb.debian.org/debian >"$dlog" 2>&1 \
    || { tail -20 "$dlog"; exit 1; }
  rm -f "$dlog"
  rm -f "$ROOT/etc/apt/sources.list"
  sec=$SUITE-security
  cat >"$ROOT/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $sec
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  echo "127.0.0.1 localhost cinode" >"$ROOT/etc/hosts"
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# Mimic this machine image's apt settings (its mirror snapshot is older than sid's Valid-Until).
for f in /etc/apt/apt.conf.d/99artifact-registry; do [ ! -f "$f" ] || cp "$f" "$ROOT/etc/apt/apt.conf.d/"; done
# ... and its TLS set-up for PyPI (CA bundle with the registry proxy's CA, pip.conf pointing at it).
[ ! -f /etc/pip.conf ] || cp /etc/pip.conf "$ROOT/etc/pip.conf"
mkdir -p "$ROOT/etc/ssl/certs" "$ROOT/usr/local/share/ca-certificates"
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true  # kept by update-ca-certificates

echo "== copying the work tree to $ROOT/root/repo (build outputs removed)"
rm -rf "$ROOT/root/repo"; mkdir -p "$ROOT/root/repo"
tar -C "$REPO" --exclude=.git -cf - . | tar -C "$ROOT/root/repo" -xf -
[ ! -f "$ROOT/root/repo/spank/Makefile" ] || make -s -C "$ROOT/root/repo/spank" clean >/dev/null
rm -rf "$ROOT/root/repo/build" "$ROOT/root/repo"/src/*.egg-info

inner() { # inner NET(yes|no) SCRIPT
  local net=$1 script=$2 flags=(--mount --pid --uts --ipc --fork --kill-child) rc=0
  [ "$net" = no ] || flags+=(--net)
  unshare "${flags[@]}" bash -c '
    set -e; R=$1
    mount --make-rprivate /
    mount --bind "$R" "$R"   # the new root must be a mount point (pivot_root; CRIU checks the mount tree)
    mount -t proc proc "$R/proc"; mount --rbind /sys "$R/sys"; mount --rbind /dev "$R/dev"
    mount -t tmpfs tmpfs "$R/run"; mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm" 2>/dev/null || true
    hostname cinode
    if [ -n "$3" ]; then
      # Own netns: loopback plus a veth pair with an address (glibc getaddrinfo(AI_ADDRCONFIG) fails with
      # loopback alone, and slurmdbd then cannot bind; this kernel has no dummy driver).
      ip link set lo up; ip link add ckptv0 type veth peer name ckptv1
      ip addr add 10.79.0.1/24 dev ckptv0; ip link set ckptv0 up; ip link set ckptv1 up
    fi
    mkdir -p "$R/.oldroot"; cd "$R"; pivot_root . .oldroot; umount -l /.oldroot
    exec /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin /bin/bash -c "$2"' _ "$ROOT" "$script" "$([ "$net" = no ] || echo 1)" &
  # If this script is stopped, unshare goes too, and --kill-child takes the whole PID namespace with it.
  INNER_PID=$!
  trap 'kill $INNER_PID 2>/dev/null' EXIT INT TERM
  wait $INNER_PID || rc=$?
  trap - EXIT INT TERM
  return $rc
}

t0=$(date +%s)
echo "== phase 1 (network): base tools + setup.sh packages criu python spank users files slurm-config"
inner no '
  set -euo pipefail
  command -v make >/dev/null || { apt-get update -qq && apt-get install -y -qq make git >/dev/null; }
  cd /root/repo
  time bash scripts/setup.sh packages criu python spank users files slurm-config
  mkdir -p /root/wheels
  /opt/slurmckpt/venv/bin/pip download -q -d /root/wheels "setuptools>=61" wheel pytest . >/dev/null
  rm -rf build src/*.egg-info
'
t1=$(date +%s)
echo "== phase 1 took $((t1 - t0)) s"
echo "== phase 2 (own netns, no network): $CMD"
inner yes "set -euo pipefail; cd /root/repo; export PIP_NO_INDEX=1 PIP_FIND_LINKS=/root/wheels; $CMD"
echo "== phase 2 took $(( $(date +%s) - t1 )) s; total $(( $(date +%s) - t0 )) s"
