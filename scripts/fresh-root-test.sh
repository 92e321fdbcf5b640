#!/usr/bin/env bash
# Developer tool: run scripts/setup.sh "from nothing" in a fresh Debian root (debootstrap minbase), as CI would on
# a new machine, without touching the host's own cluster.
#
#   scripts/fresh-root-test.sh [SUITE] [-- COMMAND]    SUITE: bookworm (default) or trixie
#
# Phase 1 (host network, own mount/PID/UTS/IPC/cgroup namespaces; scripts/debian-root.sh): apt, CRIU build, venv,
# SPANK, config. Phase 2 (also its own network namespace, so ports 3306/6817-6819 do not clash with the host):
# COMMAND, default `scripts/setup.sh` (the whole set-up incl. cluster + smoke check) followed by
# `NODES=3 scripts/setup.sh`.
# pip has no network in phase 2: phase 1 downloads the wheels it needs into the root (PIP_NO_INDEX + find-links).
# Every process started inside dies with the PID namespace. The root stays in
# /var/cache/slurmckpt/roots/fresh-<suite> (delete it to start over). scripts/slurm-suite.sh runs the
# integration tests in such a root.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=${1:-bookworm}; shift || true
[ "${1:-}" != -- ] || shift
CMD=${*:-"bash scripts/setup.sh && NODES=3 bash scripts/setup.sh && bash scripts/cluster.sh status"}
ROOT=${SLURMCKPT_CACHE:-/var/cache/slurmckpt}/roots/fresh-$SUITE
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }
# shellcheck source=scripts/debian-root.sh
. "$REPO/scripts/debian-root.sh"
root_prepare "$SUITE" "$ROOT"
echo "== copying the work tree to $ROOT/root/repo (build outputs removed)"
root_copy_repo "$REPO" "$ROOT"
inner() { root_run "$ROOT" "$@"; }

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
