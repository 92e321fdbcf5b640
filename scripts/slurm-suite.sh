#!/usr/bin/env bash
# slurm-suite.sh SUITE [-- PYTEST_ARGS...] - the integration tests against another Debian release's Slurm, on
# this machine, next to (and apart from) the host's own test cluster (docs/slurm-versions.md).
#
#   SUITE        a Debian suite, e.g. trixie (Slurm 24.11)
#   PYTEST_ARGS  what pytest runs inside, default tests/integration (`make test-2411` names a subset)
#
# 1. A Debian SUITE root (debootstrap minbase) in $SLURMCKPT_CACHE/roots/SUITE (default /var/cache/slurmckpt),
#    kept for the next run: its packages, CRIU build and venv are then already there.
# 2. Phase 1, host network, own mount/PID/UTS/IPC/cgroup namespaces (scripts/debian-root.sh): the test users,
#    then scripts/setup.sh's packages, CRIU (built there with our patches by that release's compiler), venv +
#    package, SPANK plugin and proctrack/slurmckpt built against that Slurm, config (NODES=1: one slurmd, node1).
# 3. Phase 2, the same plus its own network namespace: munged, mariadbd, slurmdbd, slurmctld, slurmd started by
#    scripts/setup.sh, a smoke job, pytest, the daemons stopped. Ports 3306/6817-6819, /etc/slurm, /run and
#    Slurm's cgroups are the root's own; whatever is left inside dies with its PID namespace.
# The test users get user ids the host does not use, so no process of either cluster belongs to a user of
# the other (the host's tests look processes up by user). Exit status: pytest's, or set-up's when that fails.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
USERS=(ckptuser1:41001 ckptuser2:41002)   # name:uid inside the root

# ------------------------------------------------------------------------------------ inside the root (as root)
inside_phase1() {
  local spec u uid
  for spec in "${USERS[@]}"; do
    u=${spec%:*} uid=${spec#*:}
    id -u "$u" >/dev/null 2>&1 && continue
    useradd --uid "$uid" --create-home --shell /bin/bash --comment "slurmckpt test user" "$u"
    passwd -l "$u" >/dev/null
  done
  NODES=1 bash scripts/setup.sh packages criu python spank users files slurm-config
}

inside_phase2() {
  # Stopped cleanly, slurmctld saves its state, and the next run's job ids go on from this run's.
  trap 'bash scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
  NODES=1 bash scripts/setup.sh cluster
  # A run that was killed leaves jobs in the saved state whose processes died with it: they would hold the node.
  local spec i
  for spec in "${USERS[@]}"; do scancel --user="${spec%:*}"; done
  for i in $(seq 60); do [ -n "$(squeue -h -o %i)" ] || break; sleep 1; done
  [ -z "$(squeue -h -o %i)" ] || { squeue >&2; echo "slurm-suite: jobs of an earlier run still queued" >&2; return 1; }
  NODES=1 bash scripts/setup.sh smoke
  echo "== $(sinfo -V) on $(. /etc/os-release; echo "$PRETTY_NAME")"
  /opt/slurmckpt/venv/bin/python -m pytest -v "$@"
}

# One node, so no shared file system is needed: the image store is a local directory (scripts/glusterfs.sh).
export SLURMCKPT_STORE_FS=local
# The package groups the tests inside need (the host's default also has the shared file system and the
# operations tools, whose tests run on the host).
export SLURMCKPT_PACKAGES="node criu-build test"

if [ "${1:-}" = --inside ]; then
  set -- "${@:2}"; phase=$1; shift
  cd "$REPO"
  case $phase in phase1) inside_phase1 ;; phase2) inside_phase2 "$@" ;; esac
  exit
fi

# ------------------------------------------------------------------------------------------------- on the host
# shellcheck source=scripts/debian-root.sh
. "$REPO/scripts/debian-root.sh"
SUITE=${1:?usage: slurm-suite.sh SUITE [-- PYTEST_ARGS...]}; shift
[ "${1:-}" != -- ] || shift
[ $# -gt 0 ] || set -- tests/integration
ROOT=${SLURMCKPT_CACHE:-/var/cache/slurmckpt}/roots/$SUITE
[ "$(id -u)" = 0 ] || { echo "slurm-suite: run as root" >&2; exit 1; }
for spec in "${USERS[@]}"; do
  ! getent passwd "${spec#*:}" >/dev/null || { echo "slurm-suite: uid ${spec#*:} is taken on this host" >&2; exit 1; }
done

elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
t0=$(date +%s)
root_prepare "$SUITE" "$ROOT"
root_copy_repo "$REPO" "$ROOT"
t1=$(date +%s)
echo "== slurm-suite $SUITE: root $ROOT ready in $(elapsed "$t0")"
echo "== phase 1 (network): test users; setup.sh packages criu python spank users files slurm-config"
root_run "$ROOT" no "cd /root/repo && bash scripts/slurm-suite.sh --inside phase1"
t2=$(date +%s)
echo "== phase 1 took $(elapsed "$t1")"
echo "== phase 2 (own network): cluster, smoke job, pytest $*"
rc=0
root_run "$ROOT" yes "cd /root/repo && bash scripts/slurm-suite.sh --inside phase2 $(printf '%q ' "$@")" || rc=$?
echo "== phase 2 took $(elapsed "$t2"); slurm-suite $SUITE total $(elapsed "$t0") (exit $rc)"
exit $rc
