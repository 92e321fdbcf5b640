#!/usr/bin/env bash
# Start/stop the slurmckpt test cluster by hand (no init system here).
#
#   scripts/cluster.sh start            munged, mariadbd, slurmdbd (+ cluster registration), slurmctld, slurmd(s);
#                                       waits until every node is idle/mixed/allocated
#   scripts/cluster.sh stop             stops all of the above (slurmd, slurmctld, slurmdbd, mariadbd, munged)
#   scripts/cluster.sh restart          restarts the Slurm daemons (slurmdbd, slurmctld, slurmd) so that config
#                                       changes take effect; munged/mariadbd are started if not running
#   scripts/cluster.sh status           daemons, nodes, partitions
#   scripts/cluster.sh logs [N]         last N (30) lines of every daemon log
#   scripts/cluster.sh stop-node NODE   multi-node: kills every process of NODE's network namespace (slurmd,
#                                       slurmstepd, job tasks) like a power-off; single node: stops slurmd only
#   scripts/cluster.sh start-node NODE  starts NODE's slurmd again and waits until it answers
#   scripts/cluster.sh net-up|net-down  create/remove the network namespaces of multi-node mode
#   scripts/cluster.sh storage-down|up  kill / start again the GlusterFS brick of the image store (tests)
# The node layout (NODES) is the one the last `scripts/setup.sh` wrote into /etc/slurm/slurm.conf.
set -euo pipefail
umask 022
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$REPO/scripts/lib.sh"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

RUN_DIR=/run/slurmckpt
LOG_DIR=$CLUSTER_DIR/log
# shellcheck source=scripts/glusterfs.sh
. "$REPO/scripts/glusterfs.sh"
WAIT_NODES_S=${SLURMCKPT_WAIT_NODES_S:-90}
declare -A SLURMD_LAUNCHED=()   # node -> epoch seconds when this run started its slurmd

# ------------------------------------------------------------------------------------------------- helpers
pid_of() { # pid_of PIDFILE COMM -> pid of a live process named COMM, or nothing
  local pf=$1 comm=$2 pid
  [ -s "$pf" ] || return 0
  pid=$(tr -dc 0-9 <"$pf")
  [ -n "$pid" ] && alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] && echo "$pid"
  return 0
}

# alive PID: the process exists and is not a zombie (PID 1 here can be slow to reap orphans).
alive() { [ -d "/proc/$1" ] && [ "$(sed -E 's/^.*\) ([A-Za-z]).*/\1/' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

stop_pidfile() { # stop_pidfile PIDFILE COMM [TIMEOUT_S]
  stop_many "${3:-30}" "$1:$2"
}

stop_many() { # stop_many TIMEOUT_S PIDFILE:COMM...: SIGTERM to all at once, wait, SIGKILL what is left
  local t=$1 spec pf comm pid i pids=() pfs=() left; shift
  for spec in "$@"; do
    pf=${spec%:*} comm=${spec##*:}
    pid=$(pid_of "$pf" "$comm")
    if [ -z "$pid" ]; then rm -f "$pf"; continue; fi
    log "stopping $comm (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    pids+=("$pid"); pfs+=("$pf")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for ((i = 0; i < t * 10; i++)); do
    left=""; for pid in "${pids[@]}"; do alive "$pid" && left+=" $pid"; done
    [ -n "$left" ] || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if alive "$pid"; then
      warn "$(cat "/proc/$pid/comm" 2>/dev/null) (pid $pid) still running after ${t}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "${pfs[@]}"
}

wait_for() { # wait_for SECONDS DESCRIPTION LOGFILE [PIDFILE:COMM] CMD...: poll CMD (10 s per try) until it succeeds
  local t=$1 what=$2 logf=$3 watch="" deadline grace; shift 3
  if [[ "$1" == /*:* ]]; then watch=$1; shift; fi
  deadline=$(( $(date +%s) + t )) grace=$(( $(date +%s) + 5 ))   # daemons write their pid file after forking
  while :; do
    timeout 10 "$@" >/dev/null 2>&1 && return 0
    if [ -n "$watch" ] && [ "$(date +%s)" -ge "$grace" ] && [ -z "$(pid_of "${watch%:*}" "${watch##*:}")" ]; then
      tail_log "$logf" 40; die "${watch##*:} died while waiting for $what"
    fi
    [ "$(date +%s)" -lt "$deadline" ] || { tail_log "$logf" 40; die "timed out after ${t}s waiting for $what"; }
    sleep 0.5
  done
}

foreign() { # foreign COMM: die if a COMM runs that we did not start in our network namespace (would hold
  # our ports); one in another network namespace (a test root of another Slurm version) holds none of them
  local comm=$1 pids
  local p me; pids=""; me=$(readlink /proc/self/ns/net)
  for p in $(pgrep -x "$comm" || true); do
    alive "$p" && [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$me" ] && pids+="$p "
  done
  [ -z "$pids" ] || die "a $comm not started by scripts/cluster.sh is running (pid $pids): stop it first"
}

node_slurmd_pidfile() { echo "$RUN_DIR/slurmd.$1.pid"; }

is_multi() { [ "$(cluster_nodes)" -gt 1 ]; }

node_index() { # nodeN -> N (multi-node names only)
  [[ "$1" =~ ^node([0-9]+)$ ]] || die "bad node name '$1' (expected node1..node$(cluster_nodes))"
  local i=${BASH_REMATCH[1]}
  [ "$i" -ge 1 ] && [ "$i" -le "$(cluster_nodes)" ] || die "no node '$1' in this cluster (node1..node$(cluster_nodes))"
  echo "$i"
}

# ------------------------------------------------------------------------------------------------- network
net_up() {
  local n i ns veth
  n=$(cluster_nodes)
  [ "$n" -gt 1 ] || return 0
  ip link show "$NET_BRIDGE" >/dev/null 2>&1 || ip link add "$NET_BRIDGE" type bridge
  ip addr replace "$NET_HOST_IP/24" dev "$NET_BRIDGE"
  ip link set "$NET_BRIDGE" up
  for i in $(seq 1 "$n"); do
    ns=node$i veth=ckpt-n$i
    ip netns list | awk '{print $1}' | grep -qx "$ns" || ip netns add "$ns"
    # Both ends must be there: a namespace made anew (an earlier run's net_down) lost its end of the pair.
    if ! ip link show "$veth" >/dev/null 2>&1 || ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "$veth" 2>/dev/null || true
      ip -n "$ns" link del eth0 2>/dev/null || true
      ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$NET_BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$NET_PREFIX.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    # No default route: a node reaches only 10.77.0.0/24 and its own loopback.
    # Node names resolve as on a real cluster (MPICH's hydra proxies connect back to mpiexec by name).
    grep -qE "^$NET_PREFIX\.$i[[:space:]]+$ns([[:space:]]|\$)" /etc/hosts ||
      echo "$NET_PREFIX.$i $ns    # slurmckpt test cluster (scripts/cluster.sh)" >> /etc/hosts
  done
}

net_down() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^node[0-9]+$' || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || { warn "killing processes left in netns $ns: $pids"; kill -KILL $pids 2>/dev/null || true; sleep 0.5; }
    ip netns del "$ns"
  done
  ip link show "$NET_BRIDGE" >/dev/null 2>&1 && ip link del "$NET_BRIDGE"
  return 0
}

# ------------------------------------------------------------------------------------------------- munge
munge_ok() { munge -n -t 5 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key; else create-munge-key -f; fi
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged || { tail_log /var/log/munge/munged.log; die "munged failed to start"; }
  wait_for 15 "munged" /var/log/munge/munged.log bash -c 'munge -n -t 5 | unmunge' 
}

stop_munge() { stop_pidfile /run/munge/munged.pid munged 10; }

# ------------------------------------------------------------------------------------------------- mariadb
MYSQLD_PID=/run/mysqld/mysqld.pid
mysqld_bin() { command -v mariadbd || command -v mysqld || die "no mariadbd/mysqld binary (mariadb-server not installed?)"; }
mysql_ok() { timeout 10 mariadb-admin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; }

start_mysql() {
  if ! mysql_ok; then
    local datadir=/var/lib/mysql
    if [ ! -d "$datadir/mysql" ]; then
      log "initialising MariaDB data directory $datadir"
      install -d -o mysql -g mysql -m 0755 "$datadir"
      mariadb-install-db --user=mysql --datadir="$datadir" --skip-test-db >"$LOG_DIR/mariadb-install-db.log" 2>&1 \
        || { tail_log "$LOG_DIR/mariadb-install-db.log"; die "mariadb-install-db failed"; }
    fi
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    touch "$LOG_DIR/mysqld.log"; chown mysql:mysql "$LOG_DIR/mysqld.log"
    log "starting mariadbd"
    setsid "$(mysqld_bin)" --user=mysql --datadir="$datadir" --pid-file="$MYSQLD_PID" --socket="$MYSQL_SOCK" \
      --bind-address=127.0.0.1 --log-error="$LOG_DIR/mysqld.log" </dev/null >/dev/null 2>&1 &
    wait_for 60 "mariadbd" "$LOG_DIR/mysqld.log" "$MYSQLD_PID:$(basename "$(mysqld_bin)")" mariadb-admin --socket="$MYSQL_SOCK" ping
  fi
  # slurmdbd connects to "localhost" through libmariadb's built-in socket path: /run/mysqld/mysqld.sock up to
  # Debian 13, /run/mariadbd/mysqld.sock in sid's MariaDB 11.8. The other path points at ours.
  local alt=/run/mariadbd/mysqld.sock
  if [ "$MYSQL_SOCK" != "$alt" ] && [ ! -e "$alt" ]; then
    install -d -o mysql -g mysql -m 0755 "$(dirname "$alt")"; ln -sfn "$MYSQL_SOCK" "$alt"
  fi
  # slurmdbd's database and user (idempotent; password generated by setup.sh).
  local pw; pw=$(cat "$CLUSTER_DIR/secret/dbpass" 2>/dev/null) || die "$CLUSTER_DIR/secret/dbpass missing: run scripts/setup.sh"
  mariadb --socket="$MYSQL_SOCK" -uroot <<EOF || die "creating the slurm_acct_db database/user failed"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

stop_mysql() {
  local pid; pid=$(pid_of "$MYSQLD_PID" "$(basename "$(mysqld_bin)")")
  [ -n "$pid" ] || { mysql_ok && warn "a MariaDB server not started by cluster.sh is running; leaving it"; return 0; }
  stop_pidfile "$MYSQLD_PID" "$(basename "$(mysqld_bin)")" 60
}

# ------------------------------------------------------------------------------------------------- slurm
start_slurmdbd() {
  if [ -z "$(pid_of "$RUN_DIR/slurmdbd.pid" slurmdbd)" ]; then
    foreign slurmdbd
    log "starting slurmdbd"
    slurmdbd || { tail_log "$LOG_DIR/slurmdbd.log"; die "slurmdbd failed to start"; }
  fi
  wait_for 60 "slurmdbd to answer (sacctmgr list cluster)" "$LOG_DIR/slurmdbd.log" "$RUN_DIR/slurmdbd.pid:slurmdbd" sacctmgr -n -P list cluster
  local name; name=$(awk -F= '/^ClusterName=/ {print $2}' "$SLURM_CONF")
  if ! sacctmgr -n -P list cluster format=Cluster | grep -qx "$name"; then
    log "registering cluster $name in slurmdbd"
    sacctmgr -i add cluster "$name" >/dev/null || die "sacctmgr -i add cluster $name failed"
  fi
}

start_slurmctld() {
  if [ -z "$(pid_of "$RUN_DIR/slurmctld.pid" slurmctld)" ]; then
    foreign slurmctld
    log "starting slurmctld"
    slurmctld || { tail_log "$LOG_DIR/slurmctld.log"; die "slurmctld failed to start"; }
  fi
  wait_for 30 "slurmctld to answer (scontrol ping)" "$LOG_DIR/slurmctld.log" "$RUN_DIR/slurmctld.pid:slurmctld" bash -c 'scontrol ping | grep -q "is UP"'
}

start_slurmd() { # start_slurmd NODE
  local node=$1 pf i
  pf=$(node_slurmd_pidfile "$node")
  [ -z "$(pid_of "$pf" slurmd)" ] || return 0
  install -d -m 0755 "$CLUSTER_DIR/spool/$node"   # SlurmdSpoolDir=.../spool/%n
  log "starting slurmd for $node"
  SLURMD_LAUNCHED[$node]=$(date +%s)
  if is_multi; then
    i=$(node_index "$node")
    ip netns list | awk '{print $1}' | grep -qx "$node" || net_up
    # The node's own network namespace, host name (its NodeHostname, as on a real cluster: MPI launchers
    # find their node in the allocation by it) and mount namespace, which holds its own client mount of
    # the image store (glusterfs.sh; later host mounts still propagate in). /run/munge, the spool and the
    # rest of the file system are the host's.
    nsenter --net="/run/netns/$node" -- unshare --uts --mount --propagation slave -- sh -c \
      'hostname "$1" && { umount -l "$2" 2>/dev/null; mount -t glusterfs "$3" "$2"; } && shift 3 && exec "$@"' \
      node-namespaces "$node" "$(storage_root)" "$(storage_source)" slurmd -N "$node" \
      || { tail_log "$LOG_DIR/slurmd.$node.log"; die "slurmd for $node failed to start"; }
  else
    slurmd -N "$node" || { tail_log "$LOG_DIR/slurmd.$node.log"; die "slurmd for $node failed to start"; }
  fi
}

slurmd_specs() { # PIDFILE:slurmd for every slurmd pid file (also nodes of an earlier NODES=)
  local pf
  for pf in "$RUN_DIR"/slurmd.*.pid; do [ -e "$pf" ] && echo "$pf:slurmd"; done
  return 0
}

node_state() { scontrol show node "$1" 2>/dev/null | sed -nE 's/^ *State=([^ ]+).*/\1/p'; }

# slurmd of NODE has registered with slurmctld since this run started it (SlurmdStartTime is new enough).
node_registered() {
  local node=$1 t since=${SLURMD_LAUNCHED[$1]:-}
  [ -n "$since" ] || return 0
  t=$(scontrol show node "$node" 2>/dev/null | sed -nE 's/.*SlurmdStartTime=([0-9T:-]+).*/\1/p')
  [ -n "$t" ] && [ "$t" != None ] || return 1
  [ "$(date -d "${t/T/ }" +%s 2>/dev/null || echo 0)" -ge $(( since - 2 )) ]
}

# wait_nodes NODE...: every node registered (no NOT_RESPONDING) and IDLE/MIXED/ALLOCATED/COMPLETING; resume
# nodes left DOWN/DRAIN by an earlier run.
wait_nodes() {
  local deadline=$(( $(date +%s) + WAIT_NODES_S )) node st pending resumed=" "
  while :; do
    pending=""
    for node in "$@"; do
      st=$(node_state "$node")
      node_registered "$node" || st="$st+NOT_REGISTERED"
      case $st in
        *NOT_REGISTERED*) pending+=" $node($st)";;
        *NOT_RESPONDING*|*"*"|"") pending+=" $node($st)";;
        *DRAIN*|DOWN*|*FAIL*|INVAL*)
          pending+=" $node($st)"
          if [[ "$resumed" != *" $node "* ]]; then
            log "resuming $node (state $st)"; scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
            resumed+="$node "
          fi;;
        IDLE*|MIXED*|ALLOCATED*|COMPLETING*) ;;
        *) pending+=" $node($st)";;
      esac
    done
    [ -n "$pending" ] || return 0
    if [ "$(date +%s)" -ge "$deadline" ]; then
      sinfo -N -l >&2 || true
      scontrol show node "$@" 2>&1 | grep -E 'NodeName|State=|Reason=' >&2 || true
      tail_log "$LOG_DIR/slurmctld.log" 30
      for node in "$@"; do tail_log "$LOG_DIR/slurmd.$node.log" 20; done
      die "timed out after ${WAIT_NODES_S}s waiting for nodes to be idle:$pending"
    fi
    sleep 1
  done
}

# ------------------------------------------------------------------------------------------------- commands
cmd_start() {
  [ -f "$SLURM_CONF" ] || die "$SLURM_CONF missing: run scripts/setup.sh (make setup) first"
  install -d -m 0755 "$RUN_DIR" "$LOG_DIR"
  if is_multi; then net_up; else net_down; fi
  start_munge
  start_storage
  start_mysql
  start_slurmdbd
  start_slurmctld
  local nodes; mapfile -t nodes < <(cluster_node_names)
  local n; for n in "${nodes[@]}"; do start_slurmd "$n"; done
  wait_nodes "${nodes[@]}"
  log "cluster up: $(sinfo -h -N -o '%N:%T' | sort -u | tr '\n' ' ')"
}

stop_slurm() {
  local specs; mapfile -t specs < <(slurmd_specs)
  stop_many 30 "${specs[@]}" "$RUN_DIR/slurmctld.pid:slurmctld" "$RUN_DIR/slurmdbd.pid:slurmdbd"
}

cmd_stop() {
  stop_slurm
  stop_mysql
  stop_storage
  stop_munge
}

cmd_status() {
  local rc=0 d pf
  printf '%-22s %s\n' munged "$(munge_ok && echo running || { rc=1; echo STOPPED; })"
  printf '%-22s %s\n' mariadbd "$(mysql_ok && echo running || { rc=1; echo STOPPED; })"
  [ "$(store_fs)" = local ] || \
    printf '%-22s %s\n' "glusterfs $GLUSTER_VOLUME" "$(brick_online && mountpoint -q "$(storage_root)" && echo "online, mounted at $(storage_root)" || { rc=1; echo DOWN; })"
  for d in slurmdbd slurmctld; do
    pf=$RUN_DIR/$d.pid
    printf '%-22s %s\n' "$d" "$( [ -n "$(pid_of "$pf" "$d")" ] && echo "running (pid $(pid_of "$pf" "$d"))" || { rc=1; echo STOPPED; })"
  done
  local node
  for node in $(cluster_node_names); do
    pf=$(node_slurmd_pidfile "$node")
    printf '%-22s %s\n' "slurmd $node" "$( [ -n "$(pid_of "$pf" slurmd)" ] && echo "running (pid $(pid_of "$pf" slurmd))" || { rc=1; echo STOPPED; })"
  done
  echo; sinfo 2>&1 || rc=1
  return $rc
}

cmd_logs() {
  local n=${1:-30} f
  for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.*.log "$LOG_DIR"/slurmdbd.log "$LOG_DIR"/mysqld.log /var/log/munge/munged.log; do
    [ -f "$f" ] && tail_log "$f" "$n"
  done
  return 0
}

cmd_stop_node() {
  local node=${1:?usage: cluster.sh stop-node NODE}
  cluster_node_names | grep -x "$node" >/dev/null || die "no node '$node' in this cluster ($(cluster_node_names | tr '\n' ' '))"
  if is_multi; then
    local pids
    pids=$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ' || true)
    log "stop-node $node: SIGKILL to every process of netns $node (${pids:-none})"
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    local i; for ((i = 0; i < 50; i++)); do [ -z "$(ip netns pids "$node" 2>/dev/null)" ] && break; sleep 0.1; done
    rm -f "$(node_slurmd_pidfile "$node")"
  else
    stop_pidfile "$(node_slurmd_pidfile "$node")" slurmd 30
  fi
}

cmd_start_node() {
  local node=${1:?usage: cluster.sh start-node NODE}
  cluster_node_names | grep -x "$node" >/dev/null || die "no node '$node' in this cluster ($(cluster_node_names | tr '\n' ' '))"
  start_slurmd "$node"
  wait_nodes "$node"
  log "$node: $(node_state "$node")"
}

need_root
case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) stop_slurm; cmd_start ;;
  status) cmd_status ;;
  logs) shift; cmd_logs "$@" ;;
  stop-node) shift; cmd_stop_node "$@" ;;
  start-node) shift; cmd_start_node "$@" ;;
  net-up) net_up ;;
  storage-down) cmd_storage_down ;;
  storage-up) cmd_storage_up ;;
  net-down) net_down ;;
  *) echo "usage: $0 {start|stop|restart|status|logs [N]|stop-node NODE|start-node NODE|net-up|net-down}" >&2; exit 2 ;;
esac
