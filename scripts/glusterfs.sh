# shellcheck shell=bash
# The image store of the test cluster on a real shared file system: a GlusterFS volume (Debian's glusterd +
# one brick on local disk), for a multi-node cluster: mounted through FUSE at storage_root on the host and by
# each node itself (its own client, over its own network namespace), the way every node of a real cluster
# mounts its NFS or Lustre. Sourced by scripts/cluster.sh. The kernels here have no NFS client (`nfs` is
# absent from /proc/filesystems); where one exists, an NFS export at storage_root works the same way
# (docs/storage.md, "Shared file systems").
#
# Fault injection for tests: `cluster.sh storage-down` kills the brick process (clients then get ENOTCONN
# at once), `cluster.sh storage-up` starts it again (clients reconnect within seconds).

GLUSTER_VOLUME=slurmckpt
GLUSTER_BRICK=$CLUSTER_DIR/gluster/brick
GLUSTER_PID=$RUN_DIR/glusterd.pid

storage_root() { # storage_root from the slurmckpt config (the path every node mounts)
  local root
  root=$(awk -F': *' '/^storage_root:/ {print $2}' /etc/slurmckpt/slurmckpt.yaml 2>/dev/null | awk '{print $1}')
  echo "${root:-/var/lib/slurmckpt/images}"
}

gluster_cli() { gluster --mode=script "$@"; }

start_glusterd() {
  if [ -z "$(pid_of "$GLUSTER_PID" glusterd)" ]; then
    foreign glusterd
    log "starting glusterd"
    glusterd -p "$GLUSTER_PID" --log-file="$LOG_DIR/glusterd.log" \
      || { tail_log "$LOG_DIR/glusterd.log"; die "glusterd failed to start"; }
  fi
  wait_for 30 "glusterd to answer (gluster volume list)" "$LOG_DIR/glusterd.log" "$GLUSTER_PID:glusterd" \
    gluster --mode=script volume list
}

# SLURMCKPT_STORE_FS=local keeps the store a plain local directory; default: glusterfs for a multi-node
# cluster, local for one node (`make demo`: its slurmd is the host itself, and the volume's brick address
# lives on the nodes' bridge, which a one-node cluster has not).
store_fs() { echo "${SLURMCKPT_STORE_FS:-$(is_multi && echo glusterfs || echo local)}"; }

start_storage() { # glusterd, the volume, and the host's mount at storage_root
  local root; root=$(storage_root)
  release_dead_mount "$root"
  if [ "$(store_fs)" = local ]; then install -d -m 0700 "$root"; return 0; fi
  start_glusterd
  if ! gluster_cli volume info "$GLUSTER_VOLUME" >/dev/null 2>&1; then
    log "creating GlusterFS volume $GLUSTER_VOLUME (brick $NET_HOST_IP:$GLUSTER_BRICK)"
    install -d -m 0700 "$GLUSTER_BRICK"
    # `force`: the brick is on the root file system, which gluster otherwise refuses
    gluster_cli volume create "$GLUSTER_VOLUME" "$NET_HOST_IP:$GLUSTER_BRICK" force >/dev/null \
      || die "gluster volume create $GLUSTER_VOLUME failed"
    # A server that stops answering is given up after 5 s (default 42): clients see ENOTCONN, not a hang.
    gluster_cli volume set "$GLUSTER_VOLUME" network.ping-timeout 5 >/dev/null
  fi
  gluster_cli volume status "$GLUSTER_VOLUME" >/dev/null 2>&1 \
    || gluster_cli volume start "$GLUSTER_VOLUME" force >/dev/null \
    || die "gluster volume start $GLUSTER_VOLUME failed"
  wait_for 30 "the brick of $GLUSTER_VOLUME to come online" "$LOG_DIR/glusterd.log" "$GLUSTER_PID:glusterd" \
    "${BRICK_ONLINE[@]}"
  install -d -m 0700 "$root"
  if ! mountpoint -q "$root"; then
    log "mounting $NET_HOST_IP:/$GLUSTER_VOLUME at $root (glusterfs over FUSE)"
    mount -t glusterfs "$NET_HOST_IP:/$GLUSTER_VOLUME" "$root" || die "mount -t glusterfs at $root failed"
  fi
  chmod 0700 "$root"
}

brick_online() { gluster_cli volume status "$GLUSTER_VOLUME" detail 2>/dev/null | grep -q '^Online *: *Y'; }
# (wait_for runs its command under `timeout`, which runs programs, not shell functions)
BRICK_ONLINE=(sh -c "gluster --mode=script volume status $GLUSTER_VOLUME detail 2>/dev/null | grep -q '^Online *: *Y'")

storage_source() { echo "$NET_HOST_IP:/$GLUSTER_VOLUME"; }   # what each node mounts at storage_root

stop_storage() {
  local root; root=$(storage_root)
  release_dead_mount "$root"
  # whatever the mode: a volume a multi-node run left mounted and served goes (a one-node restart after it)
  if [ "$(findmnt -rno FSTYPE --mountpoint "$root" 2>/dev/null)" = fuse.glusterfs ]; then umount -l "$root" || true; fi
  if [ -n "$(pid_of "$GLUSTER_PID" glusterd)" ]; then
    gluster_cli volume stop "$GLUSTER_VOLUME" >/dev/null 2>&1 || true
    stop_pidfile "$GLUSTER_PID" glusterd 20
  fi
  pkill -x glusterfsd 2>/dev/null || true
}

cmd_storage_down() {
  local pf pid
  for pf in /var/run/gluster/vols/"$GLUSTER_VOLUME"/*.pid; do
    pid=$(pid_of "$pf" glusterfsd)
    [ -n "$pid" ] && { log "storage-down: killing the brick process $pid of $GLUSTER_VOLUME"; kill -KILL "$pid"; }
  done
  return 0
}

cmd_storage_up() {
  log "storage-up: starting the brick of $GLUSTER_VOLUME again"
  gluster_cli volume start "$GLUSTER_VOLUME" force >/dev/null || die "gluster volume start failed"
  wait_for 30 "the brick of $GLUSTER_VOLUME to come online" "$LOG_DIR/glusterd.log" "$GLUSTER_PID:glusterd" "${BRICK_ONLINE[@]}"
}
