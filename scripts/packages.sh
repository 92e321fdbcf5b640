#!/usr/bin/env bash
# Debian packages slurmckpt needs, in groups, and their installation. Sourced by scripts/setup.sh (its
# `packages` step); run alone by the docker-slurm image build, whose package layer then depends on this file
# only (docker-slurm/Containerfile):
#
#   scripts/packages.sh GROUP...        install the packages of the named groups that are missing
#
# SLURMCKPT_PACKAGES (setup.sh) names the groups setup.sh installs; default: node criu-build test storage ops.
# shellcheck shell=bash disable=SC2034  # the PACKAGES_* groups are read by name in packages_of

# A Slurm node of the test cluster: daemons, accounting database, the shim's build, the Python venv.
PACKAGES_node=(
  slurmctld slurmd slurm-client slurmdbd munge libslurm-dev mariadb-server
  build-essential patch pkg-config python3 python3-venv python3-dev
  iproute2 nftables iptables procps psmisc ca-certificates xz-utils
)
# CRIU build dependencies (docs/architecture.md), with the tools to fetch, unpack, patch and compile it
PACKAGES_criu_build=(
  build-essential patch pkg-config xz-utils
  libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler python3-protobuf
  libnl-3-dev libnet1-dev libcap-dev libaio-dev libgnutls28-dev libnftables-dev libbsd-dev uuid-dev
)
# The shared libraries a CRIU built with the above links (`ldd criu`), for a node that gets the binary only.
PACKAGES_criu_runtime=(libprotobuf-c1 libnl-3-200 libnet1 libgnutls30 libnftables1 libbsd0 libuuid1)
# The linter and the real programs the integration tests run (tests/integration/test_programs.py,
# test_mpi.py); both MPIs co-exist, the tests call mpicc.openmpi / mpirun.openmpi / mpicc.mpich by name.
PACKAGES_test=(pyflakes3 gromacs openmpi-bin libopenmpi-dev mpich libmpich-dev python3-numpy)
# The test cluster's image store on a shared file system (scripts/glusterfs.sh).
PACKAGES_storage=(glusterfs-server glusterfs-client)
# Operations: the Lua Slurm's cli_filter/lua runs (tests/unit/slurm/test_cli_filter_lua.py runs etc/cli_filter.lua
# with it), node_exporter reading slurmckpt's metrics file, groff for the man pages, and what the Debian
# package depends on (scripts/build-deb.sh; tests/integration/test_package.py installs it).
PACKAGES_ops=(lua5.1 prometheus-node-exporter groff-base python3-click python3-yaml python3-xxhash python3-psutil python3-zstandard)

# packages_of GROUP...: the package names of the groups, one a line; an unknown group is an error.
packages_of() {
  local g var
  for g in "$@"; do
    var=PACKAGES_${g//-/_}
    declare -p "$var" >/dev/null 2>&1 || { echo "unknown package group '$g' (node criu-build criu-runtime test storage ops)" >&2; return 1; }
    var="${var}[@]"
    printf '%s\n' "${!var}"
  done
}

missing_packages() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ "$st" = installed ] || echo "$p"
  done
}

# No init system here: keep package postinst scripts from starting daemons we start ourselves.
with_no_daemon_start() {
  local made=0 rc=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# slurmckpt setup: no daemon starts during apt-get install\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d; made=1
  fi
  "$@" || rc=$?
  [ $made = 0 ] || rm -f /usr/sbin/policy-rc.d
  return $rc
}

# install_packages GROUP...: apt-get install what is missing (no apt-get update when nothing is).
install_packages() {
  local want miss
  want=$(packages_of "$@") || die "bad package group in: $*"
  # shellcheck disable=SC2086
  miss=$(missing_packages $want)
  if [ -z "$miss" ]; then
    log "   all $(wc -l <<<"$want") packages of '$*' already installed (no apt-get update)"
    return 0
  fi
  log "   missing: $(echo "$miss" | tr '\n' ' ')"
  apt-get update || die "apt-get update failed"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive with_no_daemon_start apt-get install -y -q --no-install-recommends $miss \
    || die "apt-get install failed for: $(echo "$miss" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  miss=$(missing_packages $want)
  [ -z "$miss" ] || die "packages still not installed after apt-get install: $miss"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  # shellcheck source=scripts/lib.sh
  . "$(dirname "$0")/lib.sh"
  need_root
  [ $# -gt 0 ] || die "usage: $0 GROUP... (node criu-build criu-runtime test storage ops)"
  install_packages "$@"
fi
