# shellcheck shell=bash
# Shared helpers for scripts/setup.sh and scripts/cluster.sh (sourced, not executed).

# Colours only on a terminal, so CI logs stay clean.
if [ -t 2 ]; then _C_B=$'\e[1m'; _C_R=$'\e[31m'; _C_Y=$'\e[33m'; _C_0=$'\e[0m'; else _C_B= _C_R= _C_Y= _C_0=; fi

# The scripts' name in their messages (docker-slurm/cluster.sh sets its own).
LOG_TAG=${LOG_TAG:-slurmckpt-setup}
log()  { printf '%s[%s]%s %s\n' "$_C_B" "$LOG_TAG" "$_C_0" "$*" >&2; }
warn() { printf '%s[%s] WARNING:%s %s\n' "$_C_Y" "$LOG_TAG" "$_C_0" "$*" >&2; }
die()  { printf '%s[%s] ERROR:%s %s\n' "$_C_R" "$LOG_TAG" "$_C_0" "$*" >&2; SLURMCKPT_DIED=1; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (try: sudo $0 $*)"; }

# Fixed paths (docs/contracts.md).
SLURMCKPT_PREFIX=/opt/slurmckpt
SLURMCKPT_VENV=$SLURMCKPT_PREFIX/venv
SLURMCKPT_CACHE=/var/cache/slurmckpt
CLUSTER_DIR=/var/lib/slurmckpt-cluster
SLURM_ETC=/etc/slurm
SLURM_CONF=$SLURM_ETC/slurm.conf
MYSQL_DATADIR=$CLUSTER_DIR/mysql
MYSQL_SOCK=/run/mysqld/mysqld.sock
# Multi-node mode (NODES>1): one slurmd per network namespace on a host bridge.
NET_BRIDGE=ckptbr0
NET_PREFIX=10.77.0
NET_HOST_IP=$NET_PREFIX.254
export SLURM_CONF

# The patch set of our CRIU builds, which names their cache directory $SLURMCKPT_CACHE/criu-VERSION-pID.
criu_patch_id() { cat "$REPO"/scripts/criu-patches/*.patch | sha256sum | cut -c1-12; }

# Print the last lines of a log file (for failure messages).
tail_log() { local f=$1 n=${2:-30}; if [ -f "$f" ]; then echo "----- last $n lines of $f -----" >&2; tail -n "$n" "$f" >&2; echo "-----" >&2; fi; }

# A FUSE mount whose server died (glusterfs after a reboot or a killed client) stays in the mount table but
# every stat of it fails with ENOTCONN, so `mountpoint`, `install -d` and `mount` all fail on it. Detach
# such a mount (lazily: processes still inside keep their references) so the path can be set up again.
release_dead_mount() {
  local path=$1
  findmnt -rn --mountpoint "$path" >/dev/null 2>&1 || return 0
  stat "$path" >/dev/null 2>&1 && return 0
  warn "$path is a dead mount ($(findmnt -rno FSTYPE,SOURCE --mountpoint "$path" | head -1)): detaching it"
  umount -l "$path" || die "umount -l $path failed"
}

# Number of nodes the current cluster was configured with (from the state file written by setup.sh).
cluster_nodes() {
  if [ -f "$CLUSTER_DIR/nodes" ]; then cat "$CLUSTER_DIR/nodes"; else echo 1; fi
}

# Names of the slurmd nodes of the current configuration (node1 alone in single-node mode).
cluster_node_names() {
  local n; n=$(cluster_nodes)
  local i; for i in $(seq 1 "$n"); do echo "node$i"; done
}
